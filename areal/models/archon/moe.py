"""Mixture-of-experts layers (Qwen3-MoE's): the top-k softmax router, grouped experts,
the MoE feed-forward that joins them (with expert-parallel token dispatch when the
parallelize function gives it an ``ep`` group), a decoder block with an MoE feed-forward,
and the load-balancing auxiliary loss (Switch Transformer's, as transformers computes it).

Expert tensor parallelism (``etp_group``, etp = tp): each tensor rank holds a slice of
every (local) expert's hidden dimension; the routed tokens, the same on every tensor
rank, enter with their gradient summed over ``etp_group`` and the partial expert outputs
are summed over it.

Routing replay: ``MoE.replay`` (``[tokens, top_k]`` expert ids, set by the model from its
``routed_experts`` argument) replaces the router's top-k choice; the weights are still the
router's softmax probabilities at those experts (renormalised when ``norm_topk_prob``),
so gradients reach the router. ``MoE.last_indices`` keeps the experts of the last forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from areal.models.archon.expert_parallel import combine, dispatch, grad_scale, reduce_partial
from areal.models.archon.layers import DecoderBlock
from areal.models.archon.ulysses import grad_all_reduce

__all__ = ["GroupedExperts", "MoE", "MoEDecoderBlock", "TopKRouter", "load_balancing_loss"]


class TopKRouter(nn.Module):
    """``gate`` [n_experts, dim]: softmax over experts (fp32), top-k, normalised if asked."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """-> (logits [n, E], weights [n, k] in x's dtype, expert ids [n, k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if replay is None:
            top, idx = torch.topk(probs, self.top_k, dim=-1)
        else:
            idx = replay.long()
            top = probs.gather(-1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class GroupedExperts(nn.Module):
    """SwiGLU experts stored as 3-D tensors ``[n_experts, out, in]``: ``w1`` gate, ``w3``
    up, ``w2`` down. Under expert parallelism each is a DTensor sharded on dim 0 over
    ``ep`` and a rank computes its local experts only."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)
        self.grad_scale = 1.0  # 1 / ep under expert parallelism (see expert_parallel)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` rows grouped by (local) expert, ``counts`` rows per expert."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (grad_scale(w, self.grad_scale) for w in (w1, w2, w3))
        outs = []
        for e, chunk in enumerate(torch.split(x, counts, dim=0)):
            if chunk.shape[0] == 0:
                continue
            h = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())
            outs.append(h @ w2[e].t())
        return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[1]))


class MoE(nn.Module):
    """Router, then each token's top-k experts (dispatched over ``ep_group`` when set),
    outputs summed with the routing weights."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.router = TopKRouter(dim, n_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden_dim, n_experts)
        self.n_experts = n_experts
        self.top_k = top_k
        self.ep_group: dist.ProcessGroup | None = None  # set by the parallelize function
        self.etp_group: dist.ProcessGroup | None = None  # expert tensor parallel (etp > 1)
        self.replay: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        self.last_indices: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.top_k
        logits, weights, idx = self.router(x, self.replay)
        self.last_logits, self.last_indices = logits, idx.detach()
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        x_sorted = x[order // k]
        if self.etp_group is not None:  # each tensor rank: a slice of the hidden dimension
            x_sorted = grad_all_reduce(x_sorted, self.etp_group)
        if self.ep_group is None:
            y_sorted = self.experts(x_sorted, counts.tolist())
        else:
            grouped, local_counts, state = dispatch(x_sorted, counts, self.ep_group)
            y_sorted = combine(self.experts(grouped, local_counts), state, self.ep_group)
        if self.etp_group is not None:
            y_sorted = reduce_partial(y_sorted, self.etp_group)
        y_sorted = y_sorted * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x)
        return out.index_add(0, order // k, y_sorted.to(x.dtype))


class MoEDecoderBlock(DecoderBlock):
    """A decoder block whose feed-forward is ``moe`` (``sparse``) or the dense SwiGLU."""

    def __init__(self, args, *, sparse: bool, **kw):
        super().__init__(args, **kw)
        self.moe = None
        if sparse:
            del self.feed_forward
            self.moe = MoE(
                args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, args.norm_topk_prob
            )

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attention(self.attention_norm(x), cos, sin, cu_seqlens)
        h = self.ffn_norm(x)
        return x + (self.moe(h) if self.moe is not None else self.feed_forward(h))


def load_balancing_loss(
    router_logits: list[torch.Tensor], n_experts: int, top_k: int
) -> torch.Tensor:
    """``n_experts * sum_e f_e * P_e`` over all layers' tokens (transformers'
    ``load_balancing_loss_func`` without a mask): ``f_e`` the fraction of top-k
    assignments to expert ``e``, ``P_e`` its mean router probability."""
    tokens = torch.zeros(n_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(tokens)
    rows = 0
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        _, sel = torch.topk(p, top_k, dim=-1)
        tokens = tokens + torch.bincount(sel.reshape(-1), minlength=n_experts).float()
        probs = probs + p.sum(0)
        rows += p.shape[0]
    return (tokens / rows * probs / rows).sum() * n_experts
