"""The code rules of DESIGN section 5 and issue 25, checked on the source.

1. Layering (docs/architecture.md, DESIGN section 2): every ``import`` / ``from ... import``
   statement of every file under ``areal/`` is read from the AST (module level and inside
   functions alike; relative imports resolved), and each package may only import the
   ``areal`` packages its row allows. ``areal.utils.logging`` is the one shared leaf every
   package may use (it imports nothing from ``areal``).
2. No import cycle among the modules under ``areal/`` (function-level imports count).
3. No use of another module's private (``_name``) names; a module whose own name starts
   with ``_`` may be imported inside its own package only.
4. No module longer than 800 lines; no function longer than 100 lines (issue 54).
5. No ``except ImportError`` around an import of areal's own modules.
6. No ``getattr(<typed config>, "field", default)``: the dataclass has the field.

Rules 2-6 share one allow-list, ``KNOWN_VIOLATIONS_TO_FIX``, for violations in files other
helpers are restructuring; it may only shrink (a listed entry that is no longer a violation
fails the test too).
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

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
        "inference",
        "infra",
        "models",
        "reward",
        "trainer",
        "utils",
        "workflow",
    },
    # generic machinery: never an engine implementation, a trainer or a workflow
    "infra": {"engine", "inference", "trainer", "workflow", "experimental", "dataset", "models"},
    "utils": {"engine", "inference", "trainer", "workflow", "experimental", "infra", "dataset"},
    # training engines: they never serve or call an inference server
    "engine": {"inference", "trainer", "workflow", "experimental", "dataset"},
    # the serving side of the wire: servers, their clients, the backend registry
    "inference": {"engine", "trainer", "workflow", "experimental", "dataset"},
    "workflow": {"engine", "inference", "trainer", "experimental"},
    "dataset": {"engine", "inference", "trainer", "workflow", "experimental", "infra"},
    "reward": {"engine", "inference", "trainer", "workflow", "experimental", "infra", "dataset"},
    "models": {"engine", "inference", "trainer", "workflow", "experimental", "infra", "dataset"},
    "experimental": {"trainer"},
}
SHARED_LEAF = "areal.utils.logging"
# Known violations waiting for a move (file, imported module prefix). Keep this empty:
# each entry names what has to change.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
# AReaL's old import paths, thin re-exports of modules that moved to another package
# (tests/test_compat_paths.py keeps them thin and keeps the project's own code off them):
# they import across the layers by design.
COMPAT_REEXPORTS = {
    "areal/engine/sglang_remote.py",
    "areal/engine/vllm_remote.py",
    "areal/infra/remote_inf_engine.py",
}


def _from_module(node: ast.ImportFrom, package: list[str]) -> str:
    """The absolute module of ``from <module> import ...`` written in ``package``."""
    if not node.level:
        return node.module or ""
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


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
            mod = _from_module(node, package)
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
        if f"areal/{rel}" in COMPAT_REEXPORTS:
            continue
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
        "def f():\n    from areal.engine.fsdp import FSDPEngine\nfrom ..trainer import rl_trainer\n"
    )
    bad = _violations(tmp_path)
    assert any("areal.engine.fsdp" in b for b in bad), bad
    assert any("areal.trainer" in b for b in bad), bad


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN))
def test_import_rules_table_names_existing_packages(pkg):
    assert (AREAL / pkg).is_dir(), f"areal/{pkg} listed in FORBIDDEN but missing"


# ---------------------------------------------------------------------------------------
# Module-level rules (issue 25, DESIGN section 5): no import cycle, no use of another
# module's private names, at most 800 lines a module, no ``except ImportError`` around the
# project's own modules, no ``getattr(<typed config>, "field", default)``.
#
# KNOWN_VIOLATIONS_TO_FIX: violations that sit in files other helpers are restructuring
# right now (issue 25 Build 3). Each entry names its owner. The lead empties these when
# merging; every test below fails on a violation that is not listed AND on a listed entry
# that is no longer a violation, so the lists can only shrink.
# ---------------------------------------------------------------------------------------

MAX_LINES = 800
MAX_FUNCTION_LINES = 100

KNOWN_VIOLATIONS_TO_FIX: dict[str, set] = {
    # Import edges (importer, imported) lying on a cycle. Every edge of each cycle is
    # listed, so a cycle that is broken anywhere leaves stale entries behind.
    "cycle_edges": set(),
    # (file, "module.private_name") used from another module.
    "private_names": {
        # helper "inference": the server's weight helpers
    },
    # files longer than MAX_LINES
    "long_modules": {},
    # "file:function" longer than MAX_FUNCTION_LINES (issue 54 Build 4: each to become a
    # short orchestration over named pieces)
    "long_functions": set(),
    # (file, imported areal module) inside a try whose handler catches ImportError
    "except_importerror": {},
    # (file, call source) of getattr(<typed config>, "field", default)
    "config_getattr": set(),
}


def _compare(kind: str, found: dict, known: set) -> list[str]:
    """Lines of a failure message: violations not in ``known`` and stale ``known`` entries.

    ``found`` maps each violation key to a human-readable description; new keys are
    printed as they would be written in the allow-list.
    """
    new = sorted(k for k in found if k not in known)
    stale = sorted(k for k in known if k not in found)
    msg = []
    if new:
        msg.append(f"{kind}: {len(new)} violation(s) not in KNOWN_VIOLATIONS_TO_FIX:")
        msg += [f"  {k!r},  # {found[k]}" for k in new]
    if stale:
        msg.append(
            f"{kind}: {len(stale)} KNOWN_VIOLATIONS_TO_FIX[{kind!r}] entries are fixed; "
            "remove them from tests/test_import_rules.py:"
        )
        msg += [f"  {k!r}," for k in stale]
    return msg


def _check(kind: str, found: dict) -> None:
    msg = _compare(kind, found, KNOWN_VIOLATIONS_TO_FIX[kind])
    if msg:
        pytest.fail("\n".join(msg), pytrace=False)


@functools.cache
def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module under ``root/areal``."""
    out = {}
    for path in sorted((root / "areal").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _rel(path: pathlib.Path, root: pathlib.Path) -> str:
    return path.relative_to(root).as_posix()


def _package_of(module: str, path: pathlib.Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes inside ``if TYPE_CHECKING:`` bodies (annotations only, never run)."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for stmt in node.body:
                ids.update(id(n) for n in ast.walk(stmt))
    return ids


def _deepest_module(name: str, mods: dict) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return None


@functools.cache
def _import_targets(module: str, root: pathlib.Path = ROOT) -> tuple:
    return tuple(_scan_import_targets(module, root))


def _scan_import_targets(module: str, root: pathlib.Path):
    """(line, target module, imported name or None, node) of each areal import in ``module``.

    Every ``Import``/``ImportFrom`` at any depth counts (module level, inside functions,
    inside ``try``), except those under ``if TYPE_CHECKING:``, which are never executed.
    ``from pkg import name`` targets ``pkg.name`` when that is a module, else ``pkg``;
    relative imports are resolved against the importing module's package.
    """
    mods = _modules(root)
    path = mods[module]
    tree = _tree(path)
    skip = _type_checking_nodes(tree)
    package = _package_of(module, path).split(".")
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _deepest_module(a.name, mods)
                if target:
                    yield node.lineno, target, None, node
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, package)
            if mod.split(".")[0] != "areal":
                continue
            for a in node.names:
                if f"{mod}.{a.name}" in mods:
                    yield node.lineno, f"{mod}.{a.name}", None, node
                else:
                    target = _deepest_module(mod, mods)
                    if target:
                        yield node.lineno, target, a.name, node


def _graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}; self-imports dropped."""
    graph: dict[str, dict[str, int]] = {}
    for module in _modules(root):
        edges: dict[str, int] = {}
        for line, target, _, _ in _import_targets(module, root):
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _a_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """One concrete cycle through the first module of ``comp`` (BFS back to it)."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _cycle_violations(root: pathlib.Path = ROOT) -> dict[tuple[str, str], str]:
    """Every import edge that lies on a cycle -> description (the cycle, with lines)."""
    graph = _graph(root)
    found = {}
    for comp in _strongly_connected(graph):
        cycle = _a_cycle(graph, comp)
        where = " -> ".join(cycle)
        members = set(comp)
        for a in comp:
            for b, line in sorted(graph[a].items()):
                if b in members:
                    found[(a, b)] = (
                        f"{_rel(_modules(root)[a], root)}:{line} imports {b} "
                        f"(cycle among {comp}: {where})"
                    )
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module_allowed(importer: str, target: str) -> bool:
    """A module whose name starts with ``_`` may be used inside its own package only."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            owner = ".".join(parts[:i])
            if not (importer == owner or importer.startswith(owner + ".")):
                return False
    return True


def _module_aliases(module: str, root: pathlib.Path) -> dict[str, str]:
    """Names in ``module`` bound to an areal module (``import a.b as m``, ``from a import b``)."""
    aliases: dict[str, str] = {}
    for _, target, name, node in _import_targets(module, root):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and _deepest_module(a.name, _modules(root)) == target:
                    aliases[a.asname] = target
                elif not a.asname:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif name is None:
            for a in node.names:
                if target.endswith("." + a.name):
                    aliases[a.asname or a.name] = target
    return aliases


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _private_violations(root: pathlib.Path = ROOT) -> dict[tuple[str, str], str]:
    """(file, "module.name") -> description of each use of another module's private name."""
    mods = _modules(root)
    found = {}
    for module, path in mods.items():
        rel = _rel(path, root)

        def flag(line, target, name, how, module=module, rel=rel) -> None:
            full = f"{target}.{name}" if name else target
            if name is not None and _is_private(name) and target != module:
                found[(rel, full)] = f"{rel}:{line} {how} {full}"
            elif not _private_module_allowed(module, target):
                found[(rel, target)] = f"{rel}:{line} {how} {target} (a private module)"

        for line, target, name, _ in _import_targets(module, root):
            flag(line, target, name, "imports")
        aliases = _module_aliases(module, root)
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            chain = _dotted(node)
            if not chain or chain[0] not in aliases:
                continue
            base = aliases[chain[0]].split(".") + chain[1:]
            # the longest prefix that is a module; the next part is the attribute used
            for i in range(len(base) - 1, 0, -1):
                if ".".join(base[:i]) in mods:
                    target, name = ".".join(base[:i]), base[i]
                    if i == len(base) - 1 and f"{target}.{name}" not in mods:
                        flag(node.lineno, target, name, "uses")
                    break
    return found


def _long_modules(root: pathlib.Path = ROOT) -> dict[str, str]:
    found = {}
    for path in _modules(root).values():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            found[_rel(path, root)] = f"{_rel(path, root)}: {n} lines (> {MAX_LINES})"
    return found


def _long_functions(root: pathlib.Path = ROOT) -> dict[str, str]:
    """``file:Class.function`` of every function (nested ones count on their own) longer
    than MAX_FUNCTION_LINES, decorators and docstring included."""
    found = {}

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                n = child.end_lineno - start + 1
                key = f"{rel}:{prefix}{child.name}"
                if n > MAX_FUNCTION_LINES:
                    found[key] = f"{key}: {n} lines (> {MAX_FUNCTION_LINES})"
                visit(child, rel, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, rel, f"{prefix}{child.name}.")
            else:
                visit(child, rel, prefix)

    for path in _modules(root).values():
        visit(ast.parse(path.read_text()), _rel(path, root), "")
    return found


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _except_importerror_violations(root: pathlib.Path = ROOT) -> dict[tuple[str, str], str]:
    """(file, areal module) imported inside a ``try`` whose handler catches ImportError."""
    found = {}
    for module, path in _modules(root).items():
        rel = _rel(path, root)
        own = {id(node): target for _, target, _, node in _import_targets(module, root)}
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Try):
                continue
            caught = set()
            for h in node.handlers:
                for n in ast.walk(h.type) if h.type is not None else ():
                    if isinstance(n, ast.Name):
                        caught.add(n.id)
                    elif isinstance(n, ast.Attribute):
                        caught.add(n.attr)
            if not caught & _IMPORT_ERRORS:
                continue
            for stmt in node.body:
                for n in ast.walk(stmt):
                    if id(n) in own:
                        found[(rel, own[id(n)])] = (
                            f"{rel}:{n.lineno} imports {own[id(n)]} under "
                            f"`except {'/'.join(sorted(caught & _IMPORT_ERRORS))}`"
                        )
    return found


_CONFIG_EXPR = re.compile(r"(^|\.)([a-z_]*_)?(config|cfg)(\.[a-z_]+)*$")


@functools.cache
def _config_field_names(root: pathlib.Path = ROOT) -> frozenset[str]:
    """Field names of the dataclass configs in ``areal/api`` (``*Config`` classes)."""
    names = set()
    for path in (root / "areal" / "api").glob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        names.add(stmt.target.id)
    return frozenset(names)


def _config_getattr_violations(root: pathlib.Path = ROOT) -> dict[tuple[str, str], str]:
    """(file, call) of ``getattr(<config expr>, "<a config field>", default)``.

    A config expression is a name or attribute chain spelled ``config``/``cfg``/
    ``xxx_config`` (``self.config``, ``config.actor``, ``exp_config``); the field is one
    that some ``XxxConfig`` dataclass in ``areal/api`` declares. The typed config has the
    field: read it. (``model.config`` of transformers is excluded: ``model.config`` names a
    Hugging Face object, and its fields are not ours.)
    """
    fields = _config_field_names(root)
    found = {}
    for path in _modules(root).values():
        rel = _rel(path, root)
        for node in ast.walk(_tree(path)):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) == 3
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                continue
            obj = ast.unparse(node.args[0])
            if not _CONFIG_EXPR.search(obj) or "model" in obj:
                continue
            if node.args[1].value not in fields:
                continue
            call = ast.unparse(node)
            found[(rel, call)] = f"{rel}:{node.lineno} {call}"
    return found


# --- the rules on the real tree ---------------------------------------------------------


def test_import_rules_no_import_cycle_among_areal_modules():
    _check("cycle_edges", _cycle_violations())


def test_import_rules_no_private_name_of_another_module():
    _check("private_names", _private_violations())


def test_import_rules_no_module_longer_than_800_lines():
    _check("long_modules", _long_modules())


def test_import_rules_no_function_longer_than_100_lines():
    _check("long_functions", _long_functions())


def test_import_rules_function_length_scanner_counts_methods_and_nested(tmp_path):
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    root = _fake_tree(
        tmp_path,
        {
            "areal/p/a.py": f"def long():\n{body}"
            f"def ok():\n{'    x = 1' + chr(10)}"
            "class C:\n    @staticmethod\n    def m():\n"
            + body.replace("    ", "        ")
            + "def outer():\n    def inner():\n"
            + body.replace("    ", "        "),
        },
    )
    assert sorted(_long_functions(root)) == [
        "areal/p/a.py:C.m",
        "areal/p/a.py:long",
        "areal/p/a.py:outer",
        "areal/p/a.py:outer.inner",
    ]


def test_import_rules_no_except_importerror_around_areal_imports():
    _check("except_importerror", _except_importerror_violations())


def test_import_rules_no_getattr_with_default_on_typed_configs():
    _check("config_getattr", _config_getattr_violations())


# --- the scanners themselves, on small fake trees ----------------------------------------


def _fake_tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in {"areal/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(tmp_path).parents:
            init = tmp_path / parent / "__init__.py"
            if parent.parts and not init.exists():
                init.write_text("")
        path.write_text(text)
    _modules.cache_clear()
    _import_targets.cache_clear()
    return tmp_path


def test_import_rules_cycle_scanner_sees_function_level_relative_and_submodule_imports(
    tmp_path,
):
    root = _fake_tree(
        tmp_path,
        {
            # a -> b at module level, b -> c via "from pkg import submodule" in a function,
            # c -> a via a relative import: one cycle of three
            "areal/p/a.py": "from areal.p.b import X\n",
            "areal/p/b.py": "X = 1\ndef f():\n    from areal.p import c\n",
            "areal/p/c.py": "from .a import X\n",
            # d <-> e only under TYPE_CHECKING: annotations, never executed, not a cycle
            "areal/p/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from areal.p.e import E\n",
            "areal/p/e.py": "from areal.p.d import *\n",
        },
    )
    found = _cycle_violations(root)
    assert set(found) == {
        ("areal.p.a", "areal.p.b"),
        ("areal.p.b", "areal.p.c"),
        ("areal.p.c", "areal.p.a"),
    }
    desc = found[("areal.p.b", "areal.p.c")]
    assert desc.startswith("areal/p/b.py:3 imports areal.p.c"), desc
    assert "areal.p.a -> areal.p.b -> areal.p.c -> areal.p.a" in desc, desc


def test_import_rules_private_scanner_flags_other_modules_names_only(tmp_path):
    root = _fake_tree(
        tmp_path,
        {
            "areal/p/a.py": "_x = 1\n__version__ = '1'\ny = _x\n",
            "areal/p/b.py": "from areal.p.a import _x, __version__\n",  # _x flagged
            "areal/p/c.py": "from areal.p import a\nz = a._x\nw = a.__version__\n",
            "areal/p/d.py": "import areal.p.a as m\ndef f():\n    return m._x\n",
            "areal/p/_helpers.py": "def h():\n    pass\n",
            "areal/p/e.py": "from areal.p._helpers import h\n",  # own package: fine
            "areal/p/sub/f.py": "from areal.p import _helpers\n",  # a subpackage: fine
            "areal/q/g.py": "from areal.p._helpers import h\n",  # another package
        },
    )
    assert sorted(_private_violations(root)) == [
        ("areal/p/b.py", "areal.p.a._x"),
        ("areal/p/c.py", "areal.p.a._x"),
        ("areal/p/d.py", "areal.p.a._x"),
        ("areal/q/g.py", "areal.p._helpers"),
    ]


def test_import_rules_line_and_importerror_scanners_flag_exactly_the_offenders(tmp_path):
    root = _fake_tree(
        tmp_path,
        {
            "areal/p/long.py": "x = 1\n" * (MAX_LINES + 1),
            "areal/p/ok.py": "x = 1\n" * MAX_LINES,
            "areal/p/a.py": "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n"
            "def f():\n    try:\n        from areal.p import ok\n"
            "    except (ModuleNotFoundError, OSError):\n        ok = None\n"
            "try:\n    from areal.p.long import x\nexcept ValueError:\n    pass\n",
        },
    )
    assert sorted(_long_modules(root)) == ["areal/p/long.py"]
    assert sorted(_except_importerror_violations(root)) == [("areal/p/a.py", "areal.p.ok")]


def test_import_rules_config_getattr_scanner_flags_config_fields_only(tmp_path):
    root = _fake_tree(
        tmp_path,
        {
            "areal/api/x_config.py": "class XConfig:\n    seed: int = 1\n",
            "areal/p/a.py": "def f(self, config, model, obj):\n"
            "    a = getattr(config, 'seed', 1)\n"  # flagged
            "    b = getattr(self.config, 'seed', 1)\n"  # flagged
            "    c = getattr(config, 'not_a_field', 1)\n"
            "    d = getattr(model.config, 'seed', 1)\n"  # a Hugging Face config
            "    e = getattr(obj, 'seed', 1)\n",
        },
    )
    _config_field_names.cache_clear()
    try:
        assert sorted(_config_getattr_violations(root)) == [
            ("areal/p/a.py", "getattr(config, 'seed', 1)"),
            ("areal/p/a.py", "getattr(self.config, 'seed', 1)"),
        ]
    finally:
        _config_field_names.cache_clear()


def test_import_rules_allow_list_fails_on_new_and_on_fixed_entries():
    found = {("f.py", "m._x"): "f.py:1 imports m._x", ("g.py", "m._y"): "g.py:2 imports m._y"}
    assert _compare("k", found, set(found)) == []
    msg = "\n".join(_compare("k", found, {("f.py", "m._x"), ("h.py", "m._z")}))
    assert "('g.py', 'm._y'),  # g.py:2 imports m._y" in msg, msg
    assert "entries are fixed" in msg and "('h.py', 'm._z')," in msg, msg
