"""``parallelize_qwen2``: tensor parallel plan of a qwen2 block, then the dense
parallelisms of ``areal.models.archon.dense_parallelize`` (tp, cp, AC, FSDP)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from areal.models.archon.dense_parallelize import parallelize_dense
from areal.models.archon.parallel_dims import ArchonParallelDims

__all__ = ["parallelize_qwen2"]

BLOCK_TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}
QK_NORMS: tuple[str, ...] = ()


def parallelize_qwen2(model: nn.Module, parallel_dims: ArchonParallelDims, **kwargs) -> nn.Module:
    """Apply tp (plan above), cp, activation checkpointing and FSDP2 to ``model``."""
    return parallelize_dense(model, parallel_dims, BLOCK_TP_PLAN, norm_names=QK_NORMS, **kwargs)
