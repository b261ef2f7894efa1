"""The package layering of docs/architecture.md (DESIGN section 2), checked on the source.

Every ``import`` / ``from ... import`` statement of every file under ``areal/`` is read
from the AST (module level and inside functions alike; relative imports resolved), and
each package may only import the ``areal`` packages its row allows. ``areal.utils.logging``
is the one shared leaf every package may use (it imports nothing from ``areal``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
AREAL = ROOT / "areal"

# package -> areal packages it must NOT import (its own package is always allowed).
FORBIDDEN: dict[str, set[str]] = {
    # contracts only
    "api": {
        "dataset",
        "engine",
        "experimental",
        "infra",
        "models",
        "reward",
        "trainer",
        "utils",
        "workflow",
    },
    # generic machinery: never an engine implementation, a trainer or a workflow
    "infra": {"engine", "trainer", "workflow", "experimental", "dataset", "models"},
    "utils": {"engine", "trainer", "workflow", "experimental", "infra", "dataset"},
    "engine": {"trainer", "workflow", "experimental", "dataset"},
    "workflow": {"engine", "trainer", "experimental"},
    "dataset": {"engine", "trainer", "workflow", "experimental", "infra"},
    "reward": {"engine", "trainer", "workflow", "experimental", "infra", "dataset"},
    "models": {"engine", "trainer", "workflow", "experimental", "infra", "dataset"},
    "experimental": {"trainer"},
}
SHARED_LEAF = "areal.utils.logging"
# Known violations waiting for a move (file, imported module prefix). Keep this empty:
# each entry names what has to change.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``."""
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from areal.utils import logging" is areal.utils.logging (a name may be a
            # submodule); "from m import *" is m itself.
            names = [a.name for a in node.names if a.name != "*"]
            out += [(node.lineno, f"{mod}.{n}") for n in names] or [(node.lineno, mod)]
    return out


def _violations(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "areal").rglob("*.py")):
        rel = path.relative_to(root / "areal")
        if len(rel.parts) < 2:
            continue  # areal/__init__.py re-exports lazily
        pkg = rel.parts[0]
        forbidden = FORBIDDEN.get(pkg, set())
        for line, mod in _imports(path, root):
            if not mod.startswith("areal."):
                continue
            if mod == SHARED_LEAF or mod.startswith(SHARED_LEAF + "."):
                continue
            target = mod.split(".")[1]
            if any(f"areal/{rel}" == f and mod.startswith(m) for f, m in KNOWN_VIOLATIONS):
                continue
            if target in forbidden and target != pkg:
                bad.append(f"areal/{rel}:{line} imports {mod} (areal.{pkg} may not use {target})")
    return bad


def test_import_rules_every_package_only_imports_allowed_layers():
    bad = _violations()
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_import_rules_shared_logging_leaf_imports_nothing_from_areal():
    mods = [m for _, m in _imports(AREAL / "utils" / "logging.py") if m.startswith("areal")]
    assert mods == []


def test_import_rules_scanner_sees_function_level_and_relative_imports(tmp_path):
    """The scanner itself: a lazy import inside a function and a relative import count."""
    fake = tmp_path / "areal" / "infra" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "def f():\n    from areal.engine.local_remote import RemoteLocalEngine\n"
        "from ..trainer import rl_trainer\n"
    )
    bad = _violations(tmp_path)
    assert any("areal.engine.local_remote" in b for b in bad), bad
    assert any("areal.trainer" in b for b in bad), bad


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN))
def test_import_rules_table_names_existing_packages(pkg):
    assert (AREAL / pkg).is_dir(), f"areal/{pkg} listed in FORBIDDEN but missing"
