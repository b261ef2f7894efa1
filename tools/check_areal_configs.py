"""Load every example YAML of an AReaL checkout with this project's config loader.

    python tools/check_areal_configs.py /path/to/AReaL/examples [--verbose]

For each ``*.yaml`` / ``*.yml`` under the given directory, the config class is the one
the example's own script passes to ``load_expr_config`` (found by reading the ``.py``
files next to the YAML). When that class is defined by the example itself (a dataclass
subclassing ``GRPOConfig`` etc. with extra fields), its dataclass definitions are read
from the example's source and built on top of ``areal.api.cli_args``, as running the
user's script here would. The YAML is then loaded unchanged with
``load_expr_config(["--config", path], cls)``.

Excluded (and counted apart): SkyPilot cluster files (``*.sky.yaml``: not AReaL
configs), reference snippets that are not experiment configs (``environ_ref.yaml``),
and configs for Ascend NPUs (``npu`` in the file name). Megatron and Archon YAMLs are
loaded like the others (a ``megatron:`` layout runs on the parallel engine here); the
settings they hold that this project accepts without acting on them are listed per file
under ``not_acted_on``.

Prints one JSON object: ``{"loaded": [...], "failed": [{"path", "class", "error"}],
"excluded": [{"path", "reason"}], "counts": {...}}``. Exit status 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import sys
import types
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areal.api import cli_args  # noqa: E402
from areal.api.experiment_config import not_acted_on_settings  # noqa: E402

_LOAD_CALL = re.compile(r"load_expr_config\(\s*[\w\[\]:.]+\s*,\s*(\w+)\s*\)")
_NOT_CONFIGS = {"environ_ref.yaml": "reference snippet of environment variables, not a config"}


def exclusion_reason(path: Path) -> str | None:
    """Why a YAML is not expected to load here, or None."""
    if path.name.endswith((".sky.yaml", ".sky.yml")):
        return "SkyPilot cluster file, not an AReaL config"
    if path.name in _NOT_CONFIGS:
        return _NOT_CONFIGS[path.name]
    if "npu" in path.name.lower() or "npu" in path.parent.name.lower():
        return "needs Ascend NPUs"
    return None


def _source_text(path: Path) -> str:
    """Python source of a script, or of a notebook's code cells."""
    text = path.read_text(errors="replace")
    if path.suffix != ".ipynb":
        return text
    try:
        cells = json.loads(text).get("cells", [])
    except ValueError:
        return ""
    return "\n\n".join("".join(c.get("source", [])) for c in cells if c.get("cell_type") == "code")


def _scripts_near(path: Path, examples_root: Path) -> list[Path]:
    """Scripts that load this YAML: those next to it (sharing its name first); else
    scripts or notebooks of the checkout that name its path; else scripts below it."""
    scripts = sorted(path.parent.glob("*.py"))
    if scripts:
        return sorted(scripts, key=lambda s: s.stem != path.stem)
    rel = f"{examples_root.name}/{path.relative_to(examples_root)}"
    mentioning = [
        s
        for pattern in ("*.py", "*.ipynb")
        for s in sorted(examples_root.parent.rglob(pattern))
        if ".git" not in s.parts and rel in s.read_text(errors="replace")
    ]
    return mentioning or sorted(path.parent.rglob("*.py"))


def config_class_name(path: Path, examples_root: Path) -> tuple[str, list[Path]]:
    """Name of the class the example's scripts load this YAML with, and those scripts."""
    scripts = _scripts_near(path, examples_root)
    same_name = [s for s in scripts if s.stem == path.stem]
    if same_name:
        found = _LOAD_CALL.findall(_source_text(same_name[0]))
        if found:
            return found[0], scripts
    names: list[str] = []
    for script in scripts:
        for name in _LOAD_CALL.findall(_source_text(script)):
            if name not in names:
                names.append(name)
    stem = path.stem.lower()
    by_token = {"sft": "SFTConfig", "rw": "RWConfig", "dpo": "DPOConfig"}
    for token, cls in by_token.items():
        if re.search(rf"(^|_){token}(_|$)", stem) and (cls in names or not names):
            return cls, scripts
    rl = [n for n in names if n not in by_token.values()]
    if rl:
        return rl[0], scripts
    if names:
        return names[0], scripts
    return "GRPOConfig", scripts  # RL examples without a script (e.g. distillation)


def _dataclass_defs(tree: ast.Module) -> list[ast.ClassDef]:
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            (isinstance(d, ast.Name) and d.id == "dataclass")
            or (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass")
            for d in node.decorator_list
        ):
            out.append(node)
    return out


def build_example_class(name: str, sources: list[Path]) -> type:
    """Build the example-defined config class ``name`` on this project's cli_args."""
    for source in sources:
        text = _source_text(source)
        if f"class {name}(" not in text:
            continue
        tree = ast.parse(text)
        defs = _dataclass_defs(tree)
        if not any(d.name == name for d in defs):
            continue
        module = types.ModuleType(f"_areal_example_{abs(hash(str(source)))}")
        namespace = module.__dict__
        namespace.update({k: getattr(cli_args, k) for k in dir(cli_args) if not k.startswith("_")})
        namespace.update(
            dataclass=dataclasses.dataclass,
            field=dataclasses.field,
            Any=typing.Any,
            Optional=typing.Optional,
            Literal=typing.Literal,
        )
        sys.modules[module.__name__] = module
        future = ast.ImportFrom("__future__", [ast.alias("annotations")], 0)
        code = ast.fix_missing_locations(ast.Module(body=[future, *defs], type_ignores=[]))
        exec(compile(code, str(source), "exec"), namespace)  # noqa: S102 - user's own config classes
        return namespace[name]
    raise LookupError(f"config class {name!r} not found in {[str(s) for s in sources]}")


def resolve_class(name: str, scripts: list[Path], yaml_path: Path, examples_root: Path) -> type:
    """The example's own class of that name when it defines one, else cli_args's."""
    near = scripts + sorted(yaml_path.parent.rglob("*.py"))
    try:
        return build_example_class(name, near)
    except LookupError:
        pass
    cls = getattr(cli_args, name, None)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return cls
    return build_example_class(name, sorted(examples_root.rglob("*.py")))


def check(examples_dir: Path) -> dict:
    examples_dir = examples_dir.resolve()
    report: dict = {"loaded": [], "failed": [], "excluded": []}
    paths = sorted(p for p in examples_dir.rglob("*") if p.suffix in (".yaml", ".yml"))
    os.environ["RANK"] = "1"  # load only: do not write the resolved config.yaml
    for path in paths:
        rel = str(path.relative_to(examples_dir))
        reason = exclusion_reason(path)
        if reason:
            report["excluded"].append({"path": rel, "reason": reason})
            continue
        name, scripts = config_class_name(path, examples_dir)
        try:
            cls = resolve_class(name, scripts, path, examples_dir)
            cfg, _ = cli_args.load_expr_config(["--config", str(path)], cls)
        except Exception as e:  # report every failure, keep going
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            report["failed"].append({"path": rel, "class": name, "error": msg})
            continue
        entry = {"path": rel, "class": name}
        not_acted = [p for p, _ in not_acted_on_settings(cfg)]
        if not_acted:
            entry["not_acted_on"] = not_acted
        report["loaded"].append(entry)
    report["counts"] = {
        "total": len(paths),
        "loaded": len(report["loaded"]),
        "failed": len(report["failed"]),
        "excluded": len(report["excluded"]),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "examples_dir", type=Path, help="the examples/ directory of an AReaL checkout"
    )
    args = parser.parse_args(argv)
    report = check(args.examples_dir)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
