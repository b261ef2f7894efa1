"""Rollout workflows: how one data item becomes trajectories.

``from areal.workflow import RLVRWorkflow, MultiTurnWorkflow`` (AReaL's names) resolve
lazily from their modules (``areal.workflow.rlvr``, ``areal.workflow.multi_turn``), so
this package import stays light. The group wrapper is
``areal.infra.grouped_workflow.GroupedRolloutWorkflow`` (re-exported as
``areal.workflow.grouped``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RLVRWorkflow": "areal.workflow.rlvr",
    "MultiTurnWorkflow": "areal.workflow.multi_turn",
    "VisionRLVRWorkflow": "areal.workflow.vision_rlvr",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'areal.workflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
