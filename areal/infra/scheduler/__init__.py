"""Schedulers that start worker processes: ``LocalScheduler``, ``RayScheduler``, ``SlurmScheduler``.

``LocalScheduler`` is imported eagerly; Ray and Slurm resolve lazily (their optional
dependencies are imported only when used).
"""

from __future__ import annotations

import importlib
from typing import Any

from areal.infra.scheduler.local import LocalScheduler

_LAZY = {
    "RayScheduler": "areal.infra.scheduler.ray",
    "SlurmScheduler": "areal.infra.scheduler.slurm",
}

__all__ = ["LocalScheduler", "RayScheduler", "SlurmScheduler"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'areal.infra.scheduler' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
