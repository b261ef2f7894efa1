"""Attention over packed micro-batches for ``FSDPEngine``: ``varlen_sdpa_attention`` (causal
SDPA per sequence, or one padded SDPA when the lengths are even enough), registered with
transformers as ``VARLEN_SDPA``, and ``plan_shared_prefixes`` (sequences that start with
the same tokens run their shared prefix once), and ``plan_tree_training`` (the layout
tree training runs: a prefix trie, or the one-level plan where the trie is no deeper)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from areal.engine.fsdp.tree_attention import (
    TreePlan,
    gather,
    length_buckets,
    padded,
    plan_tree,
    query_key_buckets,
    tree_attention,
)
from areal.utils.prefix_trie import trie_size

VARLEN_SDPA = "areal_varlen_sdpa"


# A padded batch may cost at most this many times the attention work of the sequences
# alone (sum of L^2): above it (lengths too uneven) each sequence runs on its own.
PADDED_ATTN_MAX_WASTE = 2.0
# Members of a shared-prefix group whose own lengths are within this ratio share one padded
# SDPA call (see SharedPrefixPlan).
MEMBER_BUCKET_RATIO = 0.75
# Tree training keeps the one-level layout (SharedPrefixPlan) where the trie is that deep
# only: a trie is used when it stores at least this fraction fewer rows (its general
# chain buckets ran 6-11% slower than the one-level kernels on GRPO groups and DPO pairs).
TREE_MIN_SAVING = 0.05
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
    the compressed layout and the longest segment. Attention runs as padded SDPA calls,
    each over a *bucket* of similar lengths (:data:`MEMBER_BUCKET_RATIO`: a bucket's
    shortest has at least that fraction of its longest one's tokens, so padding stays
    small when lengths spread, e.g. one- and two-turn samples, or DPO prompts of 150-300
    tokens): ``prefix_rows[j]`` ``[G_j, P_j]`` (the prefixes of a bucket of groups,
    causal), then ``member_rows[k]`` ``[M_k, L_k]`` (the own tokens of a bucket of members
    of similar own and prefix lengths) against ``member_keys[k]`` ``[M_k, P_k + L_k]``
    (its group's prefix, then its own tokens) under ``member_mask[k]`` ``[M_k, 1, L_k,
    P_k + L_k]``; index ``Nc`` is a zero padding row. ``out_index`` ``[Nc]``: where each
    compressed row's output sits in the concatenated outputs (the prefix buckets, then
    the member buckets, in order).
    """

    def __init__(self, **fields: Any):
        self.src: torch.Tensor = fields["src"]
        self.back: torch.Tensor = fields["back"]
        self.seg_cu: tuple[int, ...] = fields["seg_cu"]
        self.seg_len: int = fields["seg_len"]
        self.prefix_rows: list[torch.Tensor] = fields["prefix_rows"]
        self.member_rows: list[torch.Tensor] = fields["member_rows"]
        self.member_keys: list[torch.Tensor] = fields["member_keys"]
        self.member_mask: list[torch.Tensor] = fields["member_mask"]
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
    if len(lens) < 2:
        return None
    groups = _prefix_groups(input_ids, cu, lens, min_shared)
    n = int(cu[-1])
    saved = sum((len(m) - 1) * p for m, p in groups)
    if saved < min_saving * n:
        return None
    src, back, seg, prefixes, branches = _compressed_layout(cu, groups, n)
    out_idx, prefix_k, rows_k, keys_k, mask_k = _attention_buckets(
        prefixes, branches, int(src.numel())
    )
    dev = input_ids.device
    return SharedPrefixPlan(
        src=src.to(dev),
        back=back.to(dev),
        seg_cu=tuple(seg),
        seg_len=max(e - s for s, e in zip(seg[:-1], seg[1:])),
        prefix_rows=[t.to(dev) for t in prefix_k],
        member_rows=[t.to(dev) for t in rows_k],
        member_keys=[t.to(dev) for t in keys_k],
        member_mask=[t.to(dev) for t in mask_k],
        out_index=out_idx.to(dev),
    )


def _prefix_groups(
    input_ids: torch.Tensor, cu: torch.Tensor, lens: list[int], min_shared: int
) -> list[tuple[list[int], int]]:
    """Greedy groups of sequences by shared leading tokens: (members, shared length) each
    (a group of one shares 0)."""
    b = len(lens)
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
    return groups


def _compressed_layout(cu: torch.Tensor, groups: list[tuple[list[int], int]], n: int):
    """The compressed token order (each group's prefix once, then every member's own
    tokens): ``src`` (compressed row -> packed row), ``back`` (packed row -> compressed
    row), segment bounds, (first row, length) per prefix and (first row, length, group)
    per member."""
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
    return torch.cat(src_parts), back, seg, prefixes, branches


def _attention_buckets(
    prefixes: list[tuple[int, int]], branches: list[tuple[int, int, int]], nc: int
):
    """The batched SDPA calls' rows: prefix buckets (causal) and member buckets (own
    tokens against [the group's prefix, own earlier tokens]), their keys and masks, and
    where each compressed row's output lands (``out_idx``). Row ``nc`` is padding."""
    pmax = max(p for _, p in prefixes)
    t_p = torch.arange(pmax)
    p_start = torch.tensor([r for r, _ in prefixes])
    p_len = torch.tensor([p for _, p in prefixes])
    pq = torch.where(t_p < p_len[:, None], p_start[:, None] + t_p, nc)  # [G, pmax]
    # where each compressed row's output sits in [prefix buckets..., member buckets...]
    out_idx = torch.empty(nc, dtype=torch.long)
    offset = 0
    prefix_k = []
    shared = [g for g, (_, p) in enumerate(prefixes) if p]
    for bucket in length_buckets([prefixes[g][1] for g in shared], MEMBER_BUCKET_RATIO):
        grp = torch.tensor([shared[i] for i in bucket])
        rows = pq[grp, : int(p_len[grp].max())]
        flat_p = rows.reshape(-1)
        out_idx[flat_p[flat_p < nc]] = offset + torch.nonzero(flat_p < nc)[:, 0]
        offset += flat_p.numel()
        prefix_k.append(rows)
    rows_k, keys_k, mask_k = [], [], []
    # members of similar own lengths per call, split by the prefix length they attend to
    own = [m for _, m, _ in branches]
    keys = [prefixes[g][1] for _, _, g in branches]
    for bucket in query_key_buckets(own, keys, MEMBER_BUCKET_RATIO, MEMBER_BUCKET_RATIO):
        b_start = torch.tensor([branches[i][0] for i in bucket])
        b_len = torch.tensor([branches[i][1] for i in bucket])
        b_grp = torch.tensor([branches[i][2] for i in bucket])
        lb = int(b_len.max())
        pk = int(p_len[b_grp].max())  # the longest prefix these members attend to
        t_b = torch.arange(lb)
        bq = torch.where(t_b < b_len[:, None], b_start[:, None] + t_b, nc)  # [M_k, lb]
        bkv = torch.cat([pq[b_grp, :pk], bq], dim=1)  # [M_k, pk + lb]
        # a member's query sees its group's real prefix keys and its own earlier tokens
        # (padding query rows see their own row's earlier keys: never an empty row, no NaN)
        bmask = torch.cat(
            [
                (t_p[:pk] < p_len[b_grp][:, None])[:, None, :].expand(-1, lb, -1),
                torch.ones(lb, lb, dtype=torch.bool).tril().expand(len(bucket), -1, -1),
            ],
            dim=2,
        )
        flat_b = bq.reshape(-1)
        out_idx[flat_b[flat_b < nc]] = offset + torch.nonzero(flat_b < nc)[:, 0]
        offset += flat_b.numel()
        rows_k.append(bq)
        keys_k.append(bkv)
        mask_k.append(bmask[:, None])
    return out_idx, prefix_k, rows_k, keys_k, mask_k


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
    query, key, value = padded(query), padded(key), padded(value)
    h, d = query.shape[1], query.shape[2]
    parts = []
    for pr in plan.prefix_rows:
        out_p = F.scaled_dot_product_attention(
            gather(query, pr), gather(key, pr), gather(value, pr), dropout_p=dropout,
            is_causal=True, scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        parts.append(out_p.transpose(1, 2).reshape(-1, h, d))
    for mr, mk, mask in zip(plan.member_rows, plan.member_keys, plan.member_mask, strict=True):
        out_m = F.scaled_dot_product_attention(
            gather(query, mr), gather(key, mk), gather(value, mk), attn_mask=mask,
            dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        parts.append(out_m.transpose(1, 2).reshape(-1, h, d))
    flat = torch.cat(parts)
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
    runs as one row of a padded SDPA under the plan's prefix/branch mask; with
    ``tree_plan`` (a ``tree_attention.TreePlan``: tree training) each token attends to
    its trie ancestors. Returns
    ``[B, N, heads, D]`` like transformers' own attention functions.
    """
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN_SDPA} takes packed inputs (position_ids + cu_seq_lens_q) or right-padded "
            "rows without an attention mask"
        )
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    p = dropout if module.training else 0.0
    tree = kwargs.get("tree_plan")
    if tree is not None and query.shape[0] == 1:
        return tree_attention(tree, query, key, value, p, scaling, gqa), None
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


def plan_tree_training(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_to: int = 0, budget: int = 0
) -> TreePlan | SharedPrefixPlan | None:
    """The layout of a micro-batch under tree training (``enable_tree_training``).

    1. with padding asked for (``pad_to``: ``pad_to_maximum``), ``plan_tree``: the prefix
       trie, padded;
    2. else ``plan_shared_prefixes`` and the trie's size (``trie_size``, without building
       it): when the one-level plan stores at most ``1 / (1 - TREE_MIN_SAVING)`` times the
       trie's rows (the sharing is one level deep: GRPO groups, DPO/RW pairs) and stays
       within ``budget`` (``mb_spec.max_tokens_per_mb``, which the packer counted in trie
       rows; 0: none), the one-level plan is returned;
    3. else ``plan_tree`` (None: the sequences share nothing). Every layout is exact."""
    if pad_to:
        return plan_tree(input_ids, cu_seqlens, pad_to=pad_to)
    one = plan_shared_prefixes(input_ids, cu_seqlens)
    if one is not None:
        n_trie = trie_size(input_ids, cu_seqlens)
        within = not budget or one.n_tokens <= max(budget, n_trie)
        if within and one.n_tokens * (1 - TREE_MIN_SAVING) <= n_trie:
            return one
    return plan_tree(input_ids, cu_seqlens)
