"""Building blocks of the dense decoder families (qwen2, qwen3): RMSNorm, rotary
embedding, packed causal attention (with the Ulysses exchange when context parallel),
SwiGLU feed-forward, a decoder block.

Activations are packed: ``[tokens, hidden]`` with no batch dimension; ``cu_seqlens``
(int, ``[n_seqs + 1]``) marks where each sequence of the packed stream starts. Under
context parallelism a rank holds ``tokens / cp`` consecutive tokens of the stream and
``cu_seqlens`` describes the whole stream. Under tensor parallelism the projections are
DTensor-sharded by the family's parallelize function and the modules here see local
shards (head counts are read from the tensors, never from the config).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from areal.models.archon.ulysses import grad_all_reduce, heads_to_seq, seq_to_heads

__all__ = ["Attention", "DecoderBlock", "FeedForward", "RMSNorm", "rope_cos_sin"]


class RMSNorm(nn.Module):
    """RMS normalisation in float32, cast back, times ``weight`` (transformers' order).

    ``grad_sum_group``: when set, the weight's gradient is summed over that group (the
    norm sees only this rank's heads, e.g. Qwen3's q/k norms under tensor parallelism)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.grad_sum_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight
        if self.grad_sum_group is not None:
            w = grad_all_reduce(w, self.grad_sum_group)
        return w * h.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[tokens, head_dim]`` of the default (unscaled) rotary embedding."""
    inv = 1.0 / (
        theta
        ** (
            torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
            / head_dim
        )
    )
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal SDPA of each sequence of a packed ``[tokens, heads, dim]`` stream (GQA)."""
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    if bounds[-1] < q.shape[0]:  # padding after the last sequence attends to nothing
        out[bounds[-1] :] = 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None],
            k[s:e].transpose(0, 1)[None],
            v[s:e].transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


class Attention(nn.Module):
    """Grouped-query attention; ``qkv_bias`` (qwen2), ``qk_norm`` (qwen3)."""

    def __init__(self, args, *, qkv_bias: bool, qk_norm: bool, o_bias: bool = False):
        super().__init__()
        hd = args.head_dim
        self.head_dim = hd
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.scale = hd**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=o_bias)
        self.q_norm = RMSNorm(hd, args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, args.norm_eps) if qk_norm else None
        self.cp_group: dist.ProcessGroup | None = None  # set by the parallelize function

    def forward(self, x, cos, sin, cu_seqlens):
        n = x.shape[0]
        q = self.wq(x).view(n, -1, self.head_dim)
        k = self.wk(x).view(n, -1, self.head_dim)
        v = self.wv(x).view(n, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if self.cp_group is not None:
            cp = dist.get_world_size(self.cp_group)
            if k.shape[1] % cp:  # too few KV heads to split: one per query head
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            q, k, v = (seq_to_heads(t, self.cp_group) for t in (q, k, v))
        out = packed_causal_attention(q, k, v, cu_seqlens, self.scale)
        if self.cp_group is not None:
            out = heads_to_seq(out, self.cp_group)
        return self.wo(out.reshape(n, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (w1 gate, w3 up, w2 down)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """Pre-norm attention and feed-forward with residuals."""

    def __init__(self, args, *, qkv_bias: bool, qk_norm: bool, o_bias: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, qkv_bias=qkv_bias, qk_norm=qk_norm, o_bias=o_bias)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attention(self.attention_norm(x), cos, sin, cu_seqlens)
        return x + self.feed_forward(self.ffn_norm(x))
