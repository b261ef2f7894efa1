"""Generic machinery: schedulers, launchers, RPC, controllers, rollout execution.

AReaL's package-level names (``from areal.infra import LocalScheduler, workflow_context,
WorkflowExecutor, ...``) resolve lazily, so importing one submodule stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LocalScheduler": "areal.infra.scheduler.local",
    "RayScheduler": "areal.infra.scheduler.ray",
    "SlurmScheduler": "areal.infra.scheduler.slurm",
    "RemoteInfEngine": "areal.infra.rollout.remote_inf_engine",
    "RolloutController": "areal.infra.controller.rollout_controller",
    "TrainController": "areal.infra.controller.train_controller",
    "StalenessManager": "areal.infra.staleness_manager",
    "WorkflowExecutor": "areal.infra.workflow_executor",
    "check_trajectory_format": "areal.infra.workflow_executor",
    "GroupedRolloutWorkflow": "areal.infra.grouped_workflow",
    "AsyncTaskRunner": "areal.infra.async_task_runner",
}
_LAZY_MODULES = {"workflow_context": "areal.infra.workflow_context"}

__all__ = sorted([*_LAZY, *_LAZY_MODULES])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    else:
        raise AttributeError(f"module 'areal.infra' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
