"""Contracts: engine / workflow / scheduler interfaces, I/O structs, allocation modes.

The names AReaL re-exports here (``from areal.api import RolloutWorkflow, ModelRequest,
AsyncRewardWrapper, ...``) resolve lazily from their modules in this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TrainEngine": "areal.api.engine_api",
    "InferenceEngine": "areal.api.engine_api",
    "Scheduler": "areal.api.scheduler_api",
    "Worker": "areal.api.scheduler_api",
    "Job": "areal.api.scheduler_api",
    "AllocationMode": "areal.api.alloc_mode",
    "AllocationType": "areal.api.alloc_mode",
    "ModelAllocation": "areal.api.alloc_mode",
    "ParallelStrategy": "areal.api.alloc_mode",
    "FSDPParallelStrategy": "areal.api.alloc_mode",
    "ModelRequest": "areal.api.io_struct",
    "ModelResponse": "areal.api.io_struct",
    "WeightUpdateMeta": "areal.api.io_struct",
    "SaveLoadMeta": "areal.api.io_struct",
    "StepInfo": "areal.api.io_struct",
    "FinetuneSpec": "areal.api.io_struct",
    "ParamSpec": "areal.api.io_struct",
    "AsyncRewardWrapper": "areal.api.reward_api",
    "RolloutWorkflow": "areal.api.workflow_api",
    "AgentWorkflow": "areal.api.workflow_api",
    "WorkflowLike": "areal.api.workflow_api",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'areal.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
