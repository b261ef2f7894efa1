"""``parallelize_qwen3_moe``, in order: tensor parallel of attention (qwen2's plan; the
dense SwiGLU of mlp_only layers too; routers stay replicated over ``tp``, and so do the
experts unless etp = tp), context parallel (Ulysses), expert parallel (experts sharded
over ``ep``, tokens dispatched with all_to_all; with etp > 1 each expert's hidden
dimension over ``tp`` too), activation checkpointing, FSDP2 (experts sharded over the
data-parallel ranks left once ``ep`` is taken, ``efsdp``; the rest over ``dp_shard_cp``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from areal.models.archon.dense_parallelize import apply_ac, apply_cp
from areal.models.archon.parallel_dims import ArchonParallelDims
from areal.models.archon.qwen2.parallelize import BLOCK_TP_PLAN
from areal.models.archon.qwen3.parallelize import QK_NORMS

__all__ = ["apply_ep", "parallelize_qwen3_moe"]

ATTN_TP_PLAN = {k: v for k, v in BLOCK_TP_PLAN.items() if k.startswith("attention.")}


def _apply_tp(model: nn.Module, dims: ArchonParallelDims) -> None:
    mesh = dims.get_mesh("tp")
    for block in model.layers.values():
        parallelize_module(block, mesh, ATTN_TP_PLAN if block.moe is not None else BLOCK_TP_PLAN)
        for name in QK_NORMS:
            block.get_submodule(name).grad_sum_group = mesh.get_group()


def apply_ep(model: nn.Module, dims: ArchonParallelDims) -> None:
    """Each expert tensor becomes a DTensor sharded on dim 0 (experts) over ``ep`` and, with
    expert tensor parallelism (etp = tp), on its hidden dimension over ``tp`` (``w1``/``w3``
    dim 1, ``w2`` dim 2: a tensor rank computes a slice of each expert's SwiGLU and the
    partial outputs are summed); the MoE modules get the ``ep`` group (token dispatch)
    and the ``tp`` group, the experts a gradient scale of 1/ep."""
    hidden_dim = {"w1": 1, "w2": 2, "w3": 1}
    if dims.ep_enabled and dims.etp_enabled:
        mesh = dims.world_mesh["ep", "tp"]
        place = {w: [Shard(0), Shard(d)] for w, d in hidden_dim.items()}
    elif dims.ep_enabled:
        mesh = dims.get_mesh("ep")
        place = {w: [Shard(0)] for w in hidden_dim}
    else:
        mesh = dims.get_mesh("tp")
        place = {w: [Shard(d)] for w, d in hidden_dim.items()}
    for block in model.layers.values():
        if block.moe is None:
            continue
        experts = block.moe.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(full, mesh, place[name])))
        if dims.ep_enabled:
            experts.grad_scale = 1.0 / dims.ep
            block.moe.ep_group = dims.get_group("ep")
        if dims.etp_enabled:
            block.moe.etp_group = dims.get_group("tp")


def _apply_fsdp(model, dims, *, param_dtype, reduce_dtype, reshard_after_forward) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mp_policy=mp, reshard_after_forward=reshard_after_forward)
    mesh = dims.get_mesh("dp_shard_cp")
    for block in model.layers.values():
        inner = (
            block._checkpoint_wrapped_module
            if hasattr(block, "_checkpoint_wrapped_module")
            else block
        )
        ignored = None
        if inner.moe is not None and dims.ep_enabled:
            experts = inner.moe.experts
            if dims.efsdp > 1:
                fully_shard(experts, mesh=dims.get_mesh("efsdp"), **kw)
            else:
                ignored = set(experts.parameters())
        fully_shard(block, mesh=mesh, ignored_params=ignored, **kw)
    fully_shard(model, mesh=mesh, **kw)


def parallelize_qwen3_moe(
    model: nn.Module,
    parallel_dims: ArchonParallelDims,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    ac_every: int = 0,
    ac_preserve_rng_state: bool = False,
) -> nn.Module:
    """tp, cp, ep, activation checkpointing (``ac_every`` > 0), FSDP2 (module docstring)."""
    dims = parallel_dims
    if dims.tp_enabled:
        _apply_tp(model, dims)
    if dims.cp_enabled:
        apply_cp(model, dims)
    if dims.ep_enabled or dims.etp_enabled:
        apply_ep(model, dims)
    if ac_every > 0:
        apply_ac(model, ac_every, ac_preserve_rng_state)
    _apply_fsdp(
        model,
        dims,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
    )
    return model
