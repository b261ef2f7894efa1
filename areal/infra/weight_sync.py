"""Moved: the weight synchronizer lives in ``areal.infra.weights.weight_sync``; this path
re-exports its public names."""

from areal.infra.weights.weight_sync import (
    WeightSyncContext,
    WeightSyncError,
    WeightSyncHook,
    WeightSynchronizer,
)

__all__ = ["WeightSyncContext", "WeightSyncError", "WeightSyncHook", "WeightSynchronizer"]
