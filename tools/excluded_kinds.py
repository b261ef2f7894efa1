"""The one sentence that says which tests CI leaves out, generated from the Makefile.

    python tools/excluded_kinds.py            # print it
    python tools/excluded_kinds.py --check    # exit 1 when a page quotes another text

The kinds are the markers of the Makefile's ``NOT_HERE`` selection (what ``make test``,
``make check`` and so ``.ci/run`` deselect); each is described by the first clause of its
marker's help in ``pyproject.toml``. README.md, CONTRIBUTING.md, AGENTS.md, tests/README.md
and ``.ci/run`` quote the sentence verbatim (``.ci/run`` as one comment line);
``tests/test_excluded_kinds.py`` checks them, and that ``tests/_ci_plugin.py`` lets exactly
these kinds skip under ``CI``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where the sentence is quoted, and the prefix of its line there
QUOTED_IN = {
    "README.md": "",
    "CONTRIBUTING.md": "",
    "AGENTS.md": "",
    "tests/README.md": "",
    ".ci/run": "# ",
}


_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def kinds(makefile: Path = ROOT / "Makefile") -> list[str]:
    """The markers of ``NOT_HERE := not (a or b or c)``, in order."""
    m = re.search(r"^NOT_HERE\s*:=\s*not \(([^)]*)\)\s*$", makefile.read_text(), re.M)
    if m is None:
        raise ValueError(f"{makefile}: no line 'NOT_HERE := not (a or b ...)'")
    return [k.strip() for k in m.group(1).split(" or ")]


def descriptions(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """marker -> the first clause of its help (up to the first ';')."""
    markers = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]["markers"]
    out = {}
    for line in markers:
        name, help_ = line.split(":", 1)
        out[name.strip()] = help_.split(";", 1)[0].strip()
    return out


def sentence() -> str:
    """The generated text (one line)."""
    desc = descriptions()
    names = kinds()
    parts = [f"`{k}` {desc[k]}" for k in names]
    count = _WORDS.get(len(names), str(len(names)))
    return (
        "Left out of `make test`, `make check` and `.ci/run`, and the only tests that may skip "
        f"under `CI`, are {count} kinds (pytest markers): " + "; ".join(parts) + ". Every "
        "other test runs in `.ci/run`."
    )


def stale_pages(root: Path = ROOT) -> list[str]:
    """The pages of :data:`QUOTED_IN` that do not hold the sentence on a line of its own."""
    text = sentence()
    bad = []
    for page, prefix in QUOTED_IN.items():
        lines = (root / page).read_text().splitlines()
        if prefix + text not in lines:
            bad.append(page)
    return bad


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    ns = parser.parse_args(argv)
    if not ns.check:
        print(sentence())
        return 0
    bad = stale_pages()
    if bad:
        print(f"these pages do not quote `python tools/excluded_kinds.py` verbatim: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
