"""Resolve ``"package.module.Name"`` strings to Python objects."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_from_string"]


def import_from_string(path: str) -> Any:
    """Import ``"pkg.module.attr"`` (or ``"pkg.module:attr"``) and return the attribute."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"import path must be a non-empty string, got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"import path {path!r} must look like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} (from {path!r}): {e}") from e
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ImportError(
                f"module {module_name!r} has no attribute {attr!r} (from {path!r})"
            ) from e
    return obj
