"""Token dispatch for expert parallelism: each rank of the ``ep`` group holds
``n_experts / ep`` consecutive experts; a token routed to expert ``j`` is sent to the
rank that holds ``j`` and its result sent back, both with ``all_to_all_single`` (the
form gloo supports), differentiably.

``dispatch`` -> (tokens for this rank's experts grouped by local expert, per-local-expert
counts, the state ``combine`` needs); ``combine`` returns the results to their ranks in
the order the tokens were sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DispatchState",
    "all_to_all",
    "combine",
    "dispatch",
    "grad_scale",
    "reduce_partial",
]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with autograd (the backward is the reverse exchange)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; the gradient times ``scale`` (an expert's gradient sums the
    contributions of every ep rank, a dense one averages them: experts take ``1 / ep``)."""
    return _GradScale.apply(x, scale)


class _ReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_partial(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of the partial results of ``group``'s ranks (expert tensor parallelism: each
    holds a slice of every expert's hidden dimension); the gradient passes unchanged
    (every rank's loss is the same, its gradient already the whole)."""
    return _ReducePartial.apply(x, group)


@dataclass
class DispatchState:
    send_splits: list[int]
    recv_splits: list[int]
    unsort: torch.Tensor  # received rows regrouped by local expert -> arrival order


def dispatch(
    x_sorted: torch.Tensor, counts: torch.Tensor, group
) -> tuple[torch.Tensor, list[int], DispatchState]:
    """``x_sorted`` [m, dim]: this rank's token copies sorted by global expert id;
    ``counts`` [n_experts]: how many go to each expert. Returns the rows this rank's
    experts compute (grouped by local expert), their per-local-expert counts, the state."""
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)  # [ep * n_local]
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_by = recv_counts.view(ep, n_local)  # [source rank, local expert]
    recv_splits = recv_by.sum(1).tolist()
    rows = all_to_all(x_sorted, recv_splits, send_splits, group)
    local_ids = torch.arange(n_local, device=counts.device).repeat(ep)
    arrival_expert = torch.repeat_interleave(local_ids, recv_by.reshape(-1))
    order = torch.argsort(arrival_expert, stable=True)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    grouped = rows[order]
    local_counts = recv_by.sum(0).tolist()
    return grouped, local_counts, DispatchState(send_splits, recv_splits, unsort)


def combine(y_grouped: torch.Tensor, state: DispatchState, group) -> torch.Tensor:
    """Expert results (grouped by local expert) back to the ranks and order they came from."""
    return all_to_all(y_grouped[state.unsort], state.send_splits, state.recv_splits, group)
