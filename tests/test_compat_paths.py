"""AReaL's old import paths are thin re-exports for users; the project's own code imports
from the real modules (issue 54, Build 3).

``COMPAT_MODULES`` lists every module kept only so that an AReaL user's import keeps
working. Each must stay thin (imports and ``__all__``, no code of its own), every name it
exports must resolve, and no file under ``areal/``, ``benchmarks/`` or ``tools/`` may import
through one: a reader following an import lands on the code.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

COMPAT_MODULES = {
    "areal.engine.fsdp_engine": "areal.engine.fsdp",
    "areal.engine.sglang_remote": "areal.inference.clients.sglang",
    "areal.engine.vllm_remote": "areal.inference.clients.vllm",
    "areal.infra.async_task_runner": "areal.infra.rollout.async_task_runner",
    "areal.infra.grouped_workflow": "areal.infra.rollout.grouped_workflow",
    "areal.infra.remote_inf_engine": "areal.inference.remote.engine",
    "areal.infra.server_watchdog": "areal.infra.weights.server_watchdog",
    "areal.infra.staleness_manager": "areal.infra.rollout.staleness_manager",
    "areal.infra.weight_sync": "areal.infra.weights.weight_sync",
    "areal.infra.weight_verify": "areal.infra.weights.weight_verify",
    "areal.infra.workflow_context": "areal.infra.rollout.workflow_context",
    "areal.infra.workflow_executor": "areal.infra.rollout.workflow_executor",
    "areal.utils.functional": "areal.utils.{advantages,off_policy,rl_losses,...}",
    "areal.workflow.grouped": "areal.infra.rollout.grouped_workflow",
}
PROJECT_DIRS = ("areal", "benchmarks", "tools")


def _module_file(mod: str) -> pathlib.Path:
    return ROOT / (mod.replace(".", "/") + ".py")


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, ``from p import n`` counted as both
    ``p`` and ``p.n`` (``n`` may be a submodule)."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _compat_imports() -> list[str]:
    own = {_module_file(m) for m in COMPAT_MODULES}
    bad = []
    for d in PROJECT_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if path in own:
                continue
            for line, mod in _imported_modules(path):
                if mod in COMPAT_MODULES:
                    bad.append(
                        f"{path.relative_to(ROOT)}:{line} imports {mod} "
                        f"(a re-export; import from {COMPAT_MODULES[mod]})"
                    )
    return bad


def test_compat_paths_project_code_imports_real_modules_only():
    bad = _compat_imports()
    assert not bad, "imports through compatibility re-exports:\n" + "\n".join(bad)


@pytest.mark.parametrize("mod", sorted(COMPAT_MODULES))
def test_compat_paths_module_is_a_thin_reexport_that_resolves(mod):
    path = _module_file(mod)
    tree = ast.parse(path.read_text())
    body = [
        n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
    ]
    kinds = {type(n).__name__ for n in body}
    # imports and ``__all__`` only: no code of its own to drift from the real module
    assert kinds <= {"ImportFrom", "Import", "Assign"}, (mod, kinds)
    for n in body:
        if isinstance(n, ast.Assign):
            assert [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__all__"], mod
    module = importlib.import_module(mod)
    for name in module.__all__:
        assert getattr(module, name) is not None, (mod, name)


def test_compat_paths_scanner_sees_relative_and_from_imports(tmp_path, monkeypatch):
    """The scanner itself: ``from areal.infra import workflow_executor`` counts."""
    path = ROOT / "areal" / "utils" / "functional.py"
    found = dict((m, ln) for ln, m in _imported_modules(path))
    assert "areal.utils.advantages" in found
    src = ROOT / "tests" / "_compat_probe.py"
    try:
        src.write_text("from areal.infra import workflow_executor\n")
        mods = [m for _, m in _imported_modules(src)]
    finally:
        src.unlink()
    assert "areal.infra.workflow_executor" in mods
