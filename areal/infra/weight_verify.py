"""Moved: the verified weight sync lives in ``areal.infra.weights.weight_verify``; this path
re-exports its public names."""

from areal.infra.weights.weight_verify import (
    PATH,
    WeightFingerprintHook,
    WeightFingerprintMismatch,
)

__all__ = ["PATH", "WeightFingerprintHook", "WeightFingerprintMismatch"]
