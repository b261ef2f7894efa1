"""areal: fully asynchronous reinforcement learning for language models.

The names AReaL users import from the package work here (``from areal import PPOTrainer,
SFTTrainer, workflow_context``, ...); they are resolved lazily so that ``import areal``
stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PPOTrainer": "areal.trainer",
    "SFTTrainer": "areal.trainer",
    "RWTrainer": "areal.trainer.rw_trainer",
    "DPOTrainer": "areal.trainer.dpo_trainer",
    "RolloutController": "areal.infra.controller.rollout_controller",
    "StalenessManager": "areal.infra.staleness_manager",
    "TrainController": "areal.infra.controller.train_controller",
    "WorkflowExecutor": "areal.infra.workflow_executor",
}
_LAZY_MODULES = {"workflow_context": "areal.infra.workflow_context"}

__all__ = sorted([*_LAZY, *_LAZY_MODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    else:
        raise AttributeError(f"module 'areal' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
