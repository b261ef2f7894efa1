"""Code blocks of the documentation site are checked (see docs/index.md, "Code blocks are tested").

A fenced block preceded by a marker comment (blank lines allowed in between):

- ``<!-- test: run -->``: python blocks of one page are joined, in order, into one script run
  from the repository root; bash blocks run with ``bash -euo pipefail``.
- ``<!-- test: parse -->``: python blocks are compiled, bash blocks checked with ``bash -n``.
- ``<!-- test: config ClassName -->``: every ``--config FILE k=v ...`` command of the block is
  loaded with ``load_expr_config([...], ClassName)`` (its overrides included).
- ``<!-- test: skip -->``: not checked. Unmarked python blocks are compiled.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!--\s*test:\s*(?P<kind>run|parse|skip|config)\s*(?P<arg>\w*)\s*-->\s*$")
_PY = {"python", "py"}
_SH = {"bash", "sh", "shell"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str | None  # run / parse / skip / config / None (unmarked)
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def extract_blocks(text: str, page: Path) -> list[Block]:
    """Fenced code blocks of a Markdown text with the marker that precedes each one."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, lang = m["fence"], len(m["indent"]), m["lang"].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # closing fence
        kind, arg = None, ""
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and (mm := _MARKER.match(lines[j])):
            kind, arg = mm["kind"], mm["arg"]
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", kind, arg))
    return blocks


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p.name != "cli_reference.md")


ALL = [b for page in _pages() for b in extract_blocks(page.read_text(), page)]
RUN_PY_PAGES = sorted({b.page for b in ALL if b.kind == "run" and b.lang in _PY})
RUN_SH = [b for b in ALL if b.kind == "run" and b.lang in _SH]
PARSE = [b for b in ALL if b.kind == "parse" or (b.kind is None and b.lang in _PY)]
CONFIG = [b for b in ALL if b.kind == "config"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # `python` in a bash block is this interpreter (the project's venv)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


# ------------------------------------------------------------------ the extractor itself


def test_extract_blocks_marker_and_indent_attached_to_next_fence(tmp_path):
    text = (
        "Intro\n\n<!-- test: run -->\n\n```python\nx = 1\n```\n\n"
        "```bash\necho hi\n```\n\n"
        "1. item\n\n    <!-- test: config GRPOConfig -->\n\n    ```bash\n    python s.py --config a.yaml\n    ```\n"
    )
    blocks = extract_blocks(text, tmp_path / "p.md")
    assert [(b.lang, b.kind, b.arg) for b in blocks] == [
        ("python", "run", ""),
        ("bash", None, ""),
        ("bash", "config", "GRPOConfig"),
    ]
    assert blocks[0].code == "x = 1\n"
    assert blocks[2].code == "python s.py --config a.yaml\n"


def test_docs_have_checked_blocks_of_every_kind():
    # Guards against a marker typo silently turning every check off.
    assert len(RUN_PY_PAGES) >= 4, RUN_PY_PAGES
    assert sum(b.kind == "parse" for b in ALL) >= 5
    assert len(CONFIG) >= 2
    unknown = [
        b.where for b in ALL if b.kind == "config" and b.arg == ""
    ]  # config needs a class name
    assert not unknown, f"<!-- test: config --> without a class name at {unknown}"


# ------------------------------------------------------------------ parse / compile


@pytest.mark.parametrize("block", PARSE, ids=lambda b: b.where)
def test_block_parses(block: Block):
    if block.lang in _PY:
        # top-level `await` is allowed: snippets often show calls made inside a coroutine
        compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    elif block.lang in _SH:
        proc = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.where}: bash -n failed:\n{proc.stderr}"
    elif block.lang in ("yaml", "yml"):
        import yaml

        yaml.safe_load(block.code)


# ------------------------------------------------------------------ configs named in commands


def config_commands(code: str) -> list[list[str]]:
    """``--config FILE k=v ...`` argument lists of every command line in a bash block."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        if "--config" not in tokens:
            continue
        k = tokens.index("--config")
        args = tokens[k : k + 2]
        for tok in tokens[k + 2 :]:
            if tok.startswith("-") or "=" not in tok:
                break
            args.append(tok)
        out.append(args)
    return out


def test_config_commands_splits_continuations_and_stops_at_non_override():
    code = "python x.py --config a.yaml \\\n    k=1 +n.m=2  # note\nother --config b.yaml x y=1\n"
    assert config_commands(code) == [
        ["--config", "a.yaml", "k=1", "+n.m=2"],
        ["--config", "b.yaml"],
    ]


@pytest.mark.parametrize("block", CONFIG, ids=lambda b: b.where)
def test_config_block_loads(block: Block, tmp_path, monkeypatch):
    from areal.api import cli_args

    cls = getattr(cli_args, block.arg, None)
    assert cls is not None, f"{block.where}: no config class {block.arg!r} in areal.api.cli_args"
    commands = config_commands(block.code)
    assert commands, f"{block.where}: marked config but has no '--config FILE' command"
    monkeypatch.chdir(REPO)
    for args in commands:
        config, _ = cli_args.load_expr_config(args + [f"cluster.fileroot={tmp_path}"], cls)
        assert isinstance(config, cls)


# ------------------------------------------------------------------ run


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PY_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_run_blocks_of_page_succeed(page: Path, tmp_path):
    blocks = [b for b in ALL if b.page == page and b.kind == "run" and b.lang in _PY]
    script = tmp_path / "page_blocks.py"
    script.write_text("\n\n".join(f"# --- {b.where}\n{b.code}" for b in blocks))
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"{page.relative_to(REPO)}: run blocks failed (rc={proc.returncode})\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


@pytest.mark.parametrize("block", RUN_SH, ids=lambda b: b.where)
def test_bash_run_block_succeeds(block: Block):
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{block.where}: rc={proc.returncode}\n{proc.stderr[-4000:]}"
