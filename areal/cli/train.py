"""``areal train [run] --config X.yaml [--driver D] [key=value ...]``.

As AReaL 2.0's ``areal train run``: the driver (``module.path:func``, or a script path)
is called with ``["--config", X, *overrides]``, exactly as ``python script.py --config X
...`` would run it. Without ``--driver`` (our addition) the entry script is found beside
the YAML: the one ``*_rl.py`` for a config with ``actor:`` and ``rollout:`` sections, the
one ``*_sft.py`` for any other; ``--driver`` is required when that is ambiguous.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from pathlib import Path

import yaml


class CliError(Exception):
    """A user error: printed as ``areal: error: ...`` with exit status 2."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="run a training driver on a config (AReaL 2.0: areal train run)",
        description="Run a training driver with a config and key=value overrides. "
        "'areal train run ...' (AReaL 2.0's form) and 'areal train ...' are the same.",
    )
    p.add_argument("--config", required=True, help="experiment YAML")
    p.add_argument(
        "--driver",
        default=None,
        help="entry point: 'module.path:func' (called with the argv list) or a script "
        "path; default: the *_rl.py / *_sft.py script beside the YAML",
    )
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.set_defaults(func=run)


def _config_kind(config: Path) -> str:
    try:
        data = yaml.safe_load(config.read_text()) or {}
    except yaml.YAMLError as e:
        raise CliError(f"--config {config}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise CliError(f"--config {config}: expected a mapping at the top level")
    return "rl" if "actor" in data and "rollout" in data else "sft"


def default_driver(config: Path) -> str:
    """The entry script beside ``config`` (module docstring)."""
    kind = _config_kind(config)
    found = sorted(str(p) for p in config.parent.glob(f"*_{kind}.py"))
    if len(found) == 1:
        return found[0]
    where = f"beside {config}"
    if not found:
        raise CliError(f"no *_{kind}.py script {where}; pass --driver module.path:func or a script")
    raise CliError(f"several *_{kind}.py scripts {where} ({', '.join(found)}); pass --driver")


def run_driver(driver: str, argv: list[str]) -> int:
    """Run ``driver`` (a script path or ``module:func``) with ``argv``; its exit status."""
    if driver.endswith(".py") or os.sep in driver:
        script = Path(driver)
        if not script.is_file():
            raise CliError(f"--driver {driver}: no such script")
        old_argv, old_path = sys.argv, list(sys.path)
        sys.argv = [str(script), *argv]
        sys.path.insert(0, str(script.resolve().parent))
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv, sys.path[:] = old_argv, old_path
        return 0
    if ":" not in driver:
        raise CliError(f"--driver must be 'module.path:func' or a script path, got {driver!r}")
    mod_name, func_name = driver.split(":", 1)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise CliError(f"--driver {driver}: cannot import {mod_name!r}: {e}") from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise CliError(f"--driver {driver}: module {mod_name!r} has no function {func_name!r}")
    result = fn(argv)
    return result if isinstance(result, int) else 0


def run(args: argparse.Namespace) -> int:
    config = Path(args.config)
    if not config.is_file():
        raise CliError(f"--config {args.config}: no such file")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise CliError(f"overrides must be key=value, got {bad}")
    driver = args.driver or default_driver(config)
    return run_driver(driver, ["--config", str(config.resolve()), *args.overrides])
