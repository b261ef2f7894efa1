"""FSDP2 helpers: sharding a transformers model, LR schedules, chunked logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "PADDED_ATTN_MAX_WASTE",
    "VARLEN_SDPA",
    "ChunkedLogprobHead",
    "SharedPrefixPlan",
    "plan_shared_prefixes",
    "register_varlen_sdpa",
    "varlen_sdpa_attention",
    "apply_fsdp2",
    "chunked_logprobs_entropy",
    "find_decoder_layers",
    "lr_lambda",
]


VARLEN_SDPA = "areal_varlen_sdpa"


# A padded batch may cost at most this many times the attention work of the sequences
# alone (sum of L^2): above it (lengths too uneven) each sequence runs on its own.
PADDED_ATTN_MAX_WASTE = 2.0
_PAD_INDEX: dict[tuple, tuple[torch.Tensor, int, int]] = {}


def _padded_index(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int, int]:
    """``(flat, B, L)``: packed token ``i`` sits at row ``flat[i]`` of a ``[B * L]`` padded
    layout (sequence b at rows ``b * L ... b * L + len_b - 1``). One entry is cached: the
    same ``cu_seqlens`` serves every layer of a forward (and its backward)."""
    key = (bounds, str(device))
    hit = _PAD_INDEX.get(key)
    if hit is not None:
        return hit
    cu = torch.tensor(bounds, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    b, length = lens.numel(), int(lens.max())
    seq = torch.repeat_interleave(torch.arange(b), lens)
    flat = seq * length + (torch.arange(int(cu[-1])) - cu[:-1][seq])
    _PAD_INDEX.clear()
    _PAD_INDEX[key] = (flat.to(device), b, length)
    return _PAD_INDEX[key]


class SharedPrefixPlan:
    """Sequences of a packed micro-batch that start with the same tokens, packed once.

    GRPO's samples of one prompt share the prompt (and often the first generated tokens).
    With causal attention, a token's hidden states depend only on the tokens up to it, so
    a shared prefix gives the same activations in every sequence that has it: the plan
    lays each group out as ``[prefix, rest of member 1, rest of member 2, ...]`` (one
    *segment* per group), where a member's tokens attend to the prefix and to their own
    earlier tokens only. Forward values equal those of the per-sequence layout up to
    float rounding, and the prefix's gradients are the sum of its members' (autograd
    does it through ``index_select``).

    ``src`` ``[Nc]``: the original packed index of each token of the compressed layout;
    ``back`` ``[N]``: the compressed row holding each original token (prefix tokens of
    every member map to the group's one copy); ``seg_cu``/``seg_len``: segment bounds in
    the compressed layout and the longest segment. Attention runs as two padded SDPA
    calls: ``prefix_rows`` ``[G, P]`` (each group's prefix, causal) and ``member_rows``
    ``[M, L]`` (each member's own tokens) against ``member_keys`` ``[M, P + L]`` (its
    group's prefix, then its own tokens) under ``member_mask`` ``[M, 1, L, P + L]``;
    index ``Nc`` is a zero padding row. ``out_index`` ``[Nc]``: where each compressed
    row's output sits in the concatenated ``[G * P + M * L]`` outputs.
    """

    def __init__(self, **fields: Any):
        self.src: torch.Tensor = fields["src"]
        self.back: torch.Tensor = fields["back"]
        self.seg_cu: tuple[int, ...] = fields["seg_cu"]
        self.seg_len: int = fields["seg_len"]
        self.prefix_rows: torch.Tensor = fields["prefix_rows"]
        self.member_rows: torch.Tensor = fields["member_rows"]
        self.member_keys: torch.Tensor = fields["member_keys"]
        self.member_mask: torch.Tensor = fields["member_mask"]
        self.out_index: torch.Tensor = fields["out_index"]

    @property
    def n_tokens(self) -> int:
        return int(self.src.numel())


def plan_shared_prefixes(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    min_shared: int = 8,
    min_saving: float = 0.1,
) -> SharedPrefixPlan | None:
    """Group the packed sequences by shared leading tokens (see :class:`SharedPrefixPlan`).

    ``input_ids`` ``[N]`` packed, ``cu_seqlens`` ``[B + 1]``. A group shares at least
    ``min_shared`` tokens and every member keeps at least one token of its own. Returns
    None when grouping would save less than ``min_saving`` of the tokens (nothing to
    gain: run the plain packed layout).
    """
    cu = cu_seqlens.long().cpu()
    lens = (cu[1:] - cu[:-1]).tolist()
    b = len(lens)
    if b < 2:
        return None
    ids = input_ids.cpu()
    length = max(lens)
    pad = torch.full((b, length), -1, dtype=ids.dtype)
    flat, _, _ = _padded_index(tuple(cu.tolist()), torch.device("cpu"))
    pad.view(-1)[flat] = ids
    lens_t = torch.tensor(lens)
    assigned = [False] * b
    groups: list[tuple[list[int], int]] = []
    for i in range(b):
        if assigned[i]:
            continue
        # leading tokens sequence i has in common with every sequence (one row at a time:
        # memory B x L, and only the first sequence of each group computes one)
        lcp = (pad[i] == pad).cumprod(-1).sum(-1)
        lcp = torch.minimum(lcp, torch.minimum(lens_t, lens_t[i])).tolist()
        cand = sorted(
            (j for j in range(i + 1, b) if not assigned[j] and lcp[j] >= min_shared),
            key=lambda j: -lcp[j],
        )
        best, best_m, best_p = 0, 0, 0
        shortest = lens[i]
        for m, j in enumerate(cand, start=1):
            shortest = min(shortest, lens[j])
            p = min(lcp[j], shortest - 1)
            if p >= min_shared and m * p > best:
                best, best_m, best_p = m * p, m, p
        members = [i, *cand[:best_m]] if best_m else [i]
        for j in members:
            assigned[j] = True
        groups.append((members, best_p if best_m else 0))
    n = int(cu[-1])
    saved = sum((len(m) - 1) * p for m, p in groups)
    if saved < min_saving * n:
        return None
    src_parts: list[torch.Tensor] = []
    back = torch.empty(n, dtype=torch.long)
    seg = [0]
    # attention in two batched SDPA calls: every group's prefix (causal), and every
    # member's own tokens against [its group's prefix, its own earlier tokens]
    prefixes: list[tuple[int, int]] = []  # (first compressed row, length) per group
    branches: list[tuple[int, int, int]] = []  # (first row, length, group) per member
    for g, (members, p) in enumerate(groups):
        start = seg[-1]
        rep = int(cu[members[0]])
        src_parts.append(torch.arange(rep, rep + p))
        prefixes.append((start, p))
        off = start + p
        for j in members:
            s, e = int(cu[j]), int(cu[j + 1])
            src_parts.append(torch.arange(s + p, e))
            back[s : s + p] = torch.arange(start, start + p)
            back[s + p : e] = torch.arange(off, off + e - s - p)
            branches.append((off, e - s - p, g))
            off += e - s - p
        seg.append(off)
    src = torch.cat(src_parts)
    nc = int(src.numel())  # row nc: an all-zero row for padding
    pmax = max(p for _, p in prefixes)
    lb = max(m for _, m, _ in branches)
    t_p, t_b = torch.arange(pmax), torch.arange(lb)
    p_start = torch.tensor([r for r, _ in prefixes])
    p_len = torch.tensor([p for _, p in prefixes])
    pq = torch.where(t_p < p_len[:, None], p_start[:, None] + t_p, nc)  # [G, pmax]
    b_start = torch.tensor([r for r, _, _ in branches])
    b_len = torch.tensor([m for _, m, _ in branches])
    b_grp = torch.tensor([g for _, _, g in branches])
    bq = torch.where(t_b < b_len[:, None], b_start[:, None] + t_b, nc)  # [NB, lb]
    bkv = torch.cat([pq[b_grp], bq], dim=1)  # [NB, pmax + lb]
    # a member's query sees its group's real prefix keys and its own earlier tokens
    # (padding query rows see their own row's earlier keys: never an empty row, no NaN)
    bmask = torch.cat(
        [
            (t_p < p_len[b_grp][:, None])[:, None, :].expand(-1, lb, -1),
            torch.ones(lb, lb, dtype=torch.bool).tril().expand(len(branches), -1, -1),
        ],
        dim=2,
    )
    # where each compressed row's output sits in [prefix outputs, member outputs]
    out_idx = torch.empty(nc, dtype=torch.long)
    flat_p = pq.reshape(-1)
    out_idx[flat_p[flat_p < nc]] = torch.nonzero(flat_p < nc)[:, 0]
    flat_b = bq.reshape(-1)
    out_idx[flat_b[flat_b < nc]] = flat_p.numel() + torch.nonzero(flat_b < nc)[:, 0]
    dev = input_ids.device
    return SharedPrefixPlan(
        src=src.to(dev),
        back=back.to(dev),
        seg_cu=tuple(seg),
        seg_len=max(e - s for s, e in zip(seg[:-1], seg[1:])),
        prefix_rows=pq.to(dev),
        member_rows=bq.to(dev),
        member_keys=bkv.to(dev),
        member_mask=bmask[:, None].to(dev),
        out_index=out_idx.to(dev),
    )


def _shared_prefix_attention(
    plan: SharedPrefixPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Attention over a :class:`SharedPrefixPlan`'s compressed layout: ``[1, H, Nc, D]``
    inputs -> ``[1, Nc, H, D]``."""

    def rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # -> [n, H, k, D]
        x = x[0].transpose(0, 1)  # [Nc, H, D]
        x = torch.cat([x, x.new_zeros(1, x.shape[1], x.shape[2])])
        n, k = idx.shape
        return x.index_select(0, idx.reshape(-1)).view(n, k, x.shape[1], x.shape[2]).transpose(1, 2)

    pr, mr, mk = plan.prefix_rows, plan.member_rows, plan.member_keys
    out_p = F.scaled_dot_product_attention(
        rows(query, pr), rows(key, pr), rows(value, pr), dropout_p=dropout, is_causal=True,
        scale=scaling, enable_gqa=gqa,
    )  # fmt: skip
    out_m = F.scaled_dot_product_attention(
        rows(query, mr), rows(key, mk), rows(value, mk), attn_mask=plan.member_mask,
        dropout_p=dropout, scale=scaling, enable_gqa=gqa,
    )  # fmt: skip
    h, d = out_p.shape[1], out_p.shape[3]
    flat = torch.cat(
        [out_p.transpose(1, 2).reshape(-1, h, d), out_m.transpose(1, 2).reshape(-1, h, d)]
    )
    return flat.index_select(0, plan.out_index)[None]


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for packed sequences without flash-attn (CPU).

    With ``cu_seq_lens_q`` in ``kwargs`` (the flash-attn varlen kwargs, also given to
    ``flash_attention_2`` on GPU), attention never crosses sequence boundaries: the packed
    ``[1, heads, N, D]`` query/key/value are scattered into a right-padded
    ``[B, heads, L, D]`` batch and ONE causal SDPA runs on it (a real token only sees
    earlier tokens of its own row, never the padding after it), then the real positions
    are gathered back. When the padding would cost more than ``PADDED_ATTN_MAX_WASTE``
    times the sequences' own attention work (very uneven lengths), causal SDPA runs on
    each sequence alone instead. Both are exact up to float rounding (``tests/test_fsdp.py``).
    Without ``cu_seq_lens_q``: causal SDPA on the whole row, which is exact for unpadded
    or right-padded rows. With ``shared_prefix_plan`` in ``kwargs`` (a
    :class:`SharedPrefixPlan`; the inputs are its compressed layout), each group segment
    runs as one row of a padded SDPA under the plan's prefix/branch mask. Returns
    ``[B, N, heads, D]`` like transformers' own attention functions.
    """
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN_SDPA} takes packed inputs (position_ids + cu_seq_lens_q) or right-padded "
            "rows without an attention mask"
        )
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    p = dropout if module.training else 0.0
    plan = kwargs.get("shared_prefix_plan")
    if plan is not None and query.shape[0] == 1:
        return _shared_prefix_attention(plan, query, key, value, p, scaling, gqa), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=p,
            is_causal=query.shape[2] > 1,
            scale=scaling,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).contiguous(), None
    bounds = tuple(cu.tolist() if torch.is_tensor(cu) else cu)
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if len(lens) == 1:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=p, is_causal=lens[0] > 1, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    if len(lens) * max(lens) ** 2 <= PADDED_ATTN_MAX_WASTE * sum(n * n for n in lens):
        flat, b, length = _padded_index(bounds, query.device)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [1, H, N, D] -> [B, H, L, D]
            x = x[0].transpose(0, 1)  # [N, H, D]
            z = x.new_zeros(b * length, x.shape[1], x.shape[2]).index_copy(0, flat, x)
            return z.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            pad(query), pad(key), pad(value), dropout_p=p, is_causal=True, scale=scaling,
            enable_gqa=gqa,
        )  # fmt: skip
        h, d = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(b * length, h, d).index_select(0, flat)
        return out[None], None
    # split (one backward op for all pieces), not slices (one full-size zero tensor each)
    qs, ks, vs = (t.split(lens, dim=2) for t in (query, key, value))
    outs = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=q.shape[2] > 1, scale=scaling, enable_gqa=gqa
        )
        for q, k, v in zip(qs, ks, vs)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register_varlen_sdpa() -> str:
    """Register :func:`varlen_sdpa_attention` with transformers; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA


def lr_lambda(
    scheduler_type: str, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """LR multiplier per step for ``torch.optim.lr_scheduler.LambdaLR``.

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step
    already trains). Afterwards ``constant`` (1), ``linear`` or ``cosine`` decay from 1 to
    ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps`` steps.
    """
    if scheduler_type not in ("constant", "linear", "cosine"):
        raise ValueError(
            f"lr_scheduler_type={scheduler_type!r}; allowed: 'constant', 'linear', 'cosine'"
        )
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, int(warmup_steps))
    decay_steps = max(1, total_steps - warmup_steps)

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if scheduler_type == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
        if scheduler_type == "linear":
            return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def find_decoder_layers(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """Modules sharded as separate FSDP units: instances of ``class_names`` (default: the
    model's ``_no_split_modules``, i.e. transformers' decoder-layer classes)."""
    names = set(class_names or getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        for name in ("layers", "h", "blocks"):
            for m in model.modules():
                sub = getattr(m, name, None)
                if isinstance(sub, nn.ModuleList):
                    return list(sub)
    return layers


def apply_fsdp2(
    model: nn.Module,
    mesh,
    mp_policy=None,
    offload_policy=None,
    layer_cls_names: list[str] | None = None,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root module (in place)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload_policy or OffloadPolicy(),
    )
    for layer in find_decoder_layers(model, layer_cls_names):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _logprob_entropy_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(labels[i] | hidden[i])`` and the entropy at each row, ``chunk_size`` rows at a time.

    ``hidden`` ``[N, H]``, ``labels`` ``[N]`` -> two float32 ``[N]`` tensors; the
    entropy carries no gradient (it is for monitoring and filtering). Only one
    ``[chunk_size, vocab]`` fp32 logits block exists at a time; with autograd enabled each
    chunk is recomputed in backward (activation checkpointing) instead of keeping its
    logits.
    """
    n = hidden.shape[0]
    if n <= chunk_size:
        return _logprob_entropy_chunk(hidden, weight, bias, labels, temperature)
    logps, ents = [], []
    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, n, chunk_size):
        h, y = hidden[s : s + chunk_size], labels[s : s + chunk_size]
        if use_ckpt:
            lp, ent = checkpoint(
                _logprob_entropy_chunk, h, weight, bias, y, temperature, use_reentrant=False
            )
        else:
            lp, ent = _logprob_entropy_chunk(h, weight, bias, y, temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


class ChunkedLogprobHead(nn.Module):
    """Drop-in replacement of a causal LM's ``lm_head`` that can return logprobs directly.

    It holds the *same* ``weight`` (and ``bias``) Parameter objects as the head it
    replaces, so state-dict keys, tied embeddings and FSDP sharding are unchanged. Without
    a pending request it is a plain linear layer (logits). With ``request(labels,
    temperature)`` set, the model's forward returns ``logits`` of shape ``[1, N, 2]``
    holding (logprob of ``labels[i]`` at row i, entropy at row i), computed in chunks, so
    the full ``[N, vocab]`` logits never exist. The whole computation stays inside the
    root module's forward, where FSDP has the head's parameters unsharded.
    """

    def __init__(self, head: nn.Linear, chunk_size: int = 1024, chunk_bytes: int = 128 << 20):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.in_features = getattr(head, "in_features", head.weight.shape[1])
        self.out_features = getattr(head, "out_features", head.weight.shape[0])
        # Rows per chunk: at least chunk_size, more while one fp32 [rows, vocab] block
        # stays under chunk_bytes (no need to chunk when the logits are small).
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes
        self._labels: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._temperature = 1.0

    def request(
        self,
        labels: torch.Tensor | None,
        temperature: float = 1.0,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Return logprobs of ``labels`` from the next forward; ``rows`` (optional) picks
        the hidden row that scores each label (``labels[i]`` is scored by ``hidden[rows[i]]``,
        e.g. a shared prefix's last row for every member's first own token)."""
        self._labels = labels
        self._rows = rows
        self._temperature = float(temperature)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            return F.linear(hidden, self.weight, self.bias)
        if hidden.dim() != 3 or hidden.shape[0] != 1:
            raise ValueError(f"packed forward expects hidden [1, N, H], got {tuple(hidden.shape)}")
        rows = max(self.chunk_size, self.chunk_bytes // (4 * max(1, self.out_features)))
        h = hidden[0] if self._rows is None else hidden[0].index_select(0, self._rows)
        logp, ent = chunked_logprobs_entropy(
            h, self.weight, self.bias, self._labels, self._temperature, rows
        )
        return torch.stack([logp, ent], dim=-1).unsqueeze(0)
