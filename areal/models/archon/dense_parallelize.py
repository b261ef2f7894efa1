"""The parallelisms of a dense archon decoder, one function each, applied by a family's
parallelize function in this order: tensor parallel (``apply_tp``), context parallel
(``apply_cp``), activation checkpointing (``apply_ac``), FSDP2 (``apply_fsdp``).

Tensor parallel: DTensor ``parallelize_module`` with the family's plan (column-wise
q/k/v and gate/up projections, row-wise o/down); embeddings, norms and the output head
stay replicated over ``tp`` (their gradients are equal on every tp rank). Context
parallel: each attention module gets the ``cp`` group and exchanges heads for tokens
(Ulysses) around attention. FSDP2: ``fully_shard`` on ``dp_shard_cp`` per block, then
the root.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from areal.models.archon.parallel_dims import ArchonParallelDims

__all__ = ["apply_ac", "apply_cp", "apply_fsdp", "apply_tp", "parallelize_dense"]


def apply_tp(model: nn.Module, dims: ArchonParallelDims, block_plan: dict, norm_names=()) -> None:
    """Shard each block's projections over ``tp`` by ``block_plan`` (names inside a block).

    ``norm_names``: norms inside a block that see only this rank's heads; their weight
    gradient is summed over ``tp``."""
    mesh = dims.get_mesh("tp")
    group = mesh.get_group()
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan)
        for name in norm_names:
            block.get_submodule(name).grad_sum_group = group


def apply_cp(model: nn.Module, dims: ArchonParallelDims) -> None:
    group = dims.get_group("cp")
    for block in model.layers.values():
        block.attention.cp_group = group


def apply_ac(model: nn.Module, every: int, preserve_rng_state: bool = False) -> None:
    """Recompute every ``every``-th block in backward (1: all blocks)."""
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state)


def apply_fsdp(
    model: nn.Module,
    dims: ArchonParallelDims,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> None:
    mesh = dims.get_mesh("dp_shard_cp")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def parallelize_dense(
    model: nn.Module,
    dims: ArchonParallelDims,
    block_plan: dict,
    *,
    norm_names=(),
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    ac_every: int = 0,
    ac_preserve_rng_state: bool = False,
) -> nn.Module:
    """Tensor parallel, context parallel, activation checkpointing (``ac_every`` > 0), FSDP."""
    if dims.tp_enabled:
        apply_tp(model, dims, block_plan, norm_names)
    if dims.cp_enabled:
        apply_cp(model, dims)
    if ac_every > 0:
        apply_ac(model, ac_every, ac_preserve_rng_state)
    apply_fsdp(
        model,
        dims,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
    )
    return model
