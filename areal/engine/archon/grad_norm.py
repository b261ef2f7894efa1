"""``clip_grad_norm_``: the global gradient norm of parameters sharded over different
meshes (FSDP on ``dp_shard_cp`` for some, FSDP x tensor parallel for others), then the
clip. ``torch.nn.utils.clip_grad_norm_`` refuses to mix DTensors of different meshes.

Each gradient's squared sum is taken on its local shard and summed over the mesh
dimensions it is sharded on (not over those it is replicated on); one all-reduce per
(mesh, sharded dimension) pair.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

__all__ = ["clip_grad_norm_"]


def _sq_sums(grads: list[torch.Tensor]) -> torch.Tensor:
    buckets: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, object] = {}
    plain = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if isinstance(g, DTensor):
            local = g.to_local()
            sharded = tuple(i for i, p in enumerate(g.placements) if not isinstance(p, Replicate))
            key = (id(g.device_mesh), sharded)
            meshes[key] = g.device_mesh
            s = local.detach().double().pow(2).sum().cpu()
            buckets[key] = buckets.get(key, torch.zeros((), dtype=torch.float64)) + s
        else:
            plain += g.detach().double().pow(2).sum().cpu()
    total = plain
    for key, s in buckets.items():
        mesh, sharded = meshes[key], key[1]
        dev = mesh.device_type
        t = s.reshape(1).to(dev if dev != "cpu" else "cpu")
        for dim in sharded:
            dist.all_reduce(t, group=mesh.get_group(dim))
        total = total + t.cpu()[0]
    return total


def clip_grad_norm_(params, max_norm: float, sum_group=None) -> float:
    """Scale the gradients in place so their global L2 norm is at most ``max_norm``;
    returns the norm before clipping (``inf``/``nan`` left unclipped). ``sum_group``: a
    group whose ranks hold disjoint parameters (pipeline stages); the squared sums are
    added over it."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = _sq_sums(grads)
    if sum_group is not None:
        dev = grads[0].device if grads and grads[0].device.type == "cuda" else "cpu"
        sq = sq.reshape(1).to(dev)
        dist.all_reduce(sq, group=sum_group)
        sq = sq.cpu()[0]
    norm = math.sqrt(float(sq))
    if math.isfinite(norm) and math.isfinite(max_norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm
