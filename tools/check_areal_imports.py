"""Report which ``areal`` imports of an AReaL checkout resolve in this project.

    python tools/check_areal_imports.py /path/to/AReaL [--verbose]

Scans ``examples/**/*.py`` (parsed) and ``docs/**/*.md`` (code in the text) of the
checkout for ``from areal... import X`` and ``import areal...``, then imports each
module here and looks the name up (attribute, or submodule). Imports from code that
needs Megatron, Archon or Ascend NPUs (the module names them, or every file using the
import does), and AReaL's own test helpers (``areal.tests``), are counted apart.

Prints one JSON object: ``{"counts": {...}, "missing": [{"import", "error", "files"}],
"excluded": [...]}`` (``--verbose`` adds ``"resolved"``). Exit status 0 when nothing is
missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import sys
from collections import defaultdict

EXCLUDE_WORDS = ("megatron", "archon", "npu", "areal.tests")
_MD_FROM = re.compile(r"from\s+(areal(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)")
_MD_IMPORT = re.compile(r"^\s*import\s+(areal(?:\.\w+)*)", re.M)


def _py_imports(src: str) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "areal":
                out += [(node.module, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "areal"]
    return out


def _md_imports(src: str) -> list[tuple[str, str]]:
    out = []
    for m in _MD_FROM.finditer(src):
        for part in m.group(2).strip("()").split(","):
            name = part.split("#")[0].split(" as ")[0].strip()
            if re.fullmatch(r"\w+", name):
                out.append((m.group(1), name))
    out += [(m.group(1), "") for m in _MD_IMPORT.finditer(src)]
    return out


def scan(root: str) -> dict[tuple[str, str], set[str]]:
    """``{(module, name): {files}}`` for examples/*.py and docs/*.md under ``root``."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for sub, ext, parse in (("examples", ".py", _py_imports), ("docs", ".md", _md_imports)):
        for dirpath, _, files in os.walk(os.path.join(root, sub)):
            for fn in files:
                if not fn.endswith(ext):
                    continue
                path = os.path.join(dirpath, fn)
                with open(path, encoding="utf-8", errors="ignore") as f:
                    src = f.read()
                for key in parse(src):
                    found[key].add(os.path.relpath(path, root))
    return found


def resolve(module: str, name: str) -> str | None:
    """``None`` when ``from module import name`` (or ``import module``) works here, else why."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {e}"
    if not name:
        return None
    try:
        getattr(mod, name)
        return None
    except AttributeError:
        pass
    except Exception as e:  # noqa: BLE001 - a lazy export whose module fails to import
        return f"{type(e).__name__}: {e}"
    try:
        importlib.import_module(f"{module}.{name}")
        return None
    except Exception:  # noqa: BLE001 - not a submodule either
        return f"module {module!r} has no {name!r}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("areal_root", help="an AReaL checkout (with examples/ and docs/)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    found = scan(args.areal_root)
    resolved, missing, excluded = [], [], []
    for (module, name), files in sorted(found.items()):
        label = f"{module}:{name}" if name else module
        # excluded: the module names Megatron/Archon/NPU, or only such files use it
        if any(w in label.lower() for w in EXCLUDE_WORDS) or all(
            any(w in f.lower() for w in EXCLUDE_WORDS) for f in files
        ):
            excluded.append(label)
            continue
        err = resolve(module, name)
        if err is None:
            resolved.append(label)
        else:
            missing.append({"import": label, "error": err, "files": sorted(files)[:3]})
    total = len(resolved) + len(missing)
    report: dict = {
        "counts": {
            "imports": total,
            "resolved": len(resolved),
            "missing": len(missing),
            "excluded": len(excluded),
            "coverage": round(len(resolved) / total, 3) if total else 1.0,
        },
        "missing": missing,
        "excluded": excluded,
    }
    if args.verbose:
        report["resolved"] = resolved
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main())
