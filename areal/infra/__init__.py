"""Generic machinery, by concern:

- runtime: ``scheduler/``, ``rpc/``, ``launcher/``, ``controller/``;
- rollout (``rollout/``): the remote inference client, the workflow executor, staleness,
  grouped workflows, the workflow context, the async task runner;
- weights: ``weight_sync``, ``weight_verify``, ``server_watchdog``.

The modules once at ``areal.infra.<name>`` (``workflow_executor``, ``staleness_manager``,
``grouped_workflow``, ``workflow_context``, ``async_task_runner``, ``remote_inf_engine``)
remain as re-exports. AReaL's package-level names (``from areal.infra import
LocalScheduler, workflow_context, WorkflowExecutor, ...``) resolve lazily, so importing
one submodule stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LocalScheduler": "areal.infra.scheduler.local",
    "RayScheduler": "areal.infra.scheduler.ray",
    "SlurmScheduler": "areal.infra.scheduler.slurm",
    "RemoteInfEngine": "areal.inference.remote.engine",
    "RolloutController": "areal.infra.controller.rollout_controller",
    "TrainController": "areal.infra.controller.train_controller",
    "StalenessManager": "areal.infra.rollout.staleness_manager",
    "WorkflowExecutor": "areal.infra.rollout.workflow_executor",
    "check_trajectory_format": "areal.infra.rollout.workflow_executor",
    "GroupedRolloutWorkflow": "areal.infra.rollout.grouped_workflow",
    "AsyncTaskRunner": "areal.infra.rollout.async_task_runner",
}
# AReaL's module path (a re-export of areal.infra.rollout.workflow_context): the object
# ``from areal import workflow_context`` gives too.
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
