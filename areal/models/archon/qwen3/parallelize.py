"""``parallelize_qwen3``: tensor parallel plan of a qwen3 block (qwen2's: q/k/v and
gate/up column-wise, o and down row-wise), then the dense parallelisms of
``areal.models.archon.dense_parallelize`` (tp, cp, AC, FSDP)."""

from __future__ import annotations

from torch import nn

from areal.models.archon.dense_parallelize import parallelize_dense
from areal.models.archon.parallel_dims import ArchonParallelDims
from areal.models.archon.qwen2.parallelize import BLOCK_TP_PLAN

__all__ = ["parallelize_qwen3"]

# q/k norms act on this rank's heads only: their gradients are summed over tp
QK_NORMS = ("attention.q_norm", "attention.k_norm")


def parallelize_qwen3(model: nn.Module, parallel_dims: ArchonParallelDims, **kwargs) -> nn.Module:
    """Apply tp (qwen2's plan), cp, activation checkpointing and FSDP2 to ``model``."""
    return parallelize_dense(model, parallel_dims, BLOCK_TP_PLAN, norm_names=QK_NORMS, **kwargs)
