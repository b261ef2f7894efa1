"""Differentiable collectives of context (Ulysses) and tensor parallelism, in the forms
gloo supports (``all_to_all_single``, ``all_gather``, ``all_reduce``).

- ``seq_to_heads(x, group)``: ``[S/cp, H, D]`` (this rank's tokens, all heads) ->
  ``[S, H/cp, D]`` (all tokens, this rank's heads); ``heads_to_seq`` is its inverse, and
  each is the other's backward.
- ``gather_seq(x, group)``: concatenate every rank's tokens (dim 0); backward keeps the
  sum of every rank's gradient of this rank's part.
- ``grad_all_reduce(w, group)``: identity forward, gradient summed over ``group``
  (a replicated weight applied to this rank's heads only, e.g. Qwen3's q/k norms under
  tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_seq", "grad_all_reduce", "heads_to_seq", "seq_to_heads"]


def _a2a(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()  # before empty_like: it would copy a permuted input's strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    s, h, d = x.shape
    if h % n:
        raise ValueError(f"Ulysses: {h} heads are not divisible by context-parallel size {n}")
    chunks = x.reshape(s, n, h // n, d).permute(1, 0, 2, 3)  # [n (head chunk), s, h/n, d]
    return _a2a(chunks, group).reshape(n * s, h // n, d)  # received chunks: seq order


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    s_full, h_local, d = x.shape
    chunks = x.reshape(n, s_full // n, h_local, d)  # [n (seq chunk), s, h/n, d]
    out = _a2a(chunks, group)  # [n (head chunk), s, h/n, d]
    return out.permute(1, 0, 2, 3).reshape(s_full // n, n * h_local, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.n = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _HeadsToSeq.apply(x, group)


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherSeq.apply(x, group)


def grad_all_reduce(w: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GradAllReduce.apply(w, group)
