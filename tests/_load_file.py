"""``load_file(name, path)``: import a script that is not in a package (``tools/``,
``benchmarks/``) as module ``name``, registered in ``sys.modules`` (dataclasses and
pickling look it up there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
