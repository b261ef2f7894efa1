"""Tree training for ``FSDPEngine`` (``enable_tree_training``): a micro-batch's sequences
laid out as their prefix trie (``areal.utils.prefix_trie``), every shared token once,
and attention where each token sees exactly its ancestors.

``plan_tree`` builds a :class:`TreePlan`, which the engine uses like the one-level
``SharedPrefixPlan`` (the compressed layout ``src``, the way back ``back``); its
attention runs each chain of new tokens as the queries of a padded SDPA call against the
keys of its path (the ancestors it shares, then its own earlier tokens) under an
explicit boolean mask, chains of similar lengths batched together. Position ids are the
depth of each token in its sequence, which is the same in every sequence through a node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from areal.utils.prefix_trie import trie_nodes

# chains batched into one SDPA call have query and key lengths within this ratio
CHAIN_BUCKET_RATIO = 0.75


class TreePlan:
    """The trie layout of a packed micro-batch.

    ``src`` ``[Nc]``: the packed index of each stored token (padding rows, see
    ``pad_to``, repeat index 0); ``back`` ``[N]``: the stored row of each packed token;
    ``rows[k]`` ``[M_k, Lq]`` / ``keys[k]`` ``[M_k, Lk]`` / ``mask[k]`` ``[M_k, 1, Lq,
    Lk]``: per bucket of chains, each chain's stored rows, its path's rows (ancestors,
    then its own) and which keys each query sees; index ``Nc`` is a zero row;
    ``out_index`` ``[Nc]``: where each stored row's output sits among the buckets'
    concatenated outputs."""

    def __init__(self, **fields: Any):
        self.src: torch.Tensor = fields["src"]
        self.back: torch.Tensor = fields["back"]
        self.seg_cu: tuple[int, ...] = fields["seg_cu"]
        self.seg_len: int = fields["seg_len"]
        self.rows: list[torch.Tensor] = fields["rows"]
        self.keys: list[torch.Tensor] = fields["keys"]
        self.mask: list[torch.Tensor] = fields["mask"]
        self.out_index: torch.Tensor = fields["out_index"]
        self.n_stored: int = fields["n_stored"]  # trie tokens, without the padding rows

    @property
    def n_tokens(self) -> int:
        return int(self.src.numel())


def length_buckets(lengths: list[int], ratio: float) -> list[list[int]]:
    """Indices of ``lengths`` in buckets, longest first; within a bucket the shortest is
    at least ``ratio`` of the longest (the rows of one padded SDPA call)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lengths[i] >= ratio * lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def query_key_buckets(
    q_len: list[int], k_len: list[int], q_ratio: float, k_ratio: float
) -> list[list[int]]:
    """Items by query length (``length_buckets``), each bucket split again by key length,
    so neither the query rows nor the key rows of a padded call are mostly padding."""
    out: list[list[int]] = []
    for bucket in length_buckets(q_len, q_ratio):
        for part in length_buckets([k_len[i] for i in bucket], k_ratio):
            out.append([bucket[j] for j in part])
    return out


def plan_tree(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_to: int = 0
) -> TreePlan | None:
    """The :class:`TreePlan` of a packed micro-batch, or None when its sequences share no
    leading token (nothing to gain: the flat packed layout). ``pad_to`` (``pad_to_maximum``)
    appends padding rows, each attending to itself only, up to that many stored rows."""
    trie = trie_nodes(input_ids, cu_seqlens)
    n = int(cu_seqlens[-1])
    if trie.n_nodes == n and pad_to <= n:
        return None
    chains = list(trie.chains)
    src = trie.src.cpu()
    extra = max(0, pad_to - trie.n_nodes)
    if extra:
        src = torch.cat([src, torch.zeros(extra, dtype=torch.long)])
        chains += [(-1, trie.n_nodes + i, 1, 0) for i in range(extra)]
    nc = trie.n_nodes + extra  # row nc: an all-zero row for padding
    q_len = [c[2] for c in chains]
    k_len = [c[2] + c[3] for c in chains]
    out_idx = torch.empty(nc, dtype=torch.long)
    rows_k, keys_k, mask_k = [], [], []
    offset = 0
    # chains of similar lengths per call; keys split where they spread by more than 2x
    for bucket in query_key_buckets(q_len, k_len, CHAIN_BUCKET_RATIO, 0.5):
        lq = max(q_len[i] for i in bucket)
        pk = max(chains[i][3] for i in bucket)
        rows = torch.full((len(bucket), lq), nc, dtype=torch.long)
        keys = torch.full((len(bucket), pk + lq), nc, dtype=torch.long)
        mask = torch.zeros(len(bucket), lq, pk + lq, dtype=torch.bool)
        tril = torch.ones(lq, lq, dtype=torch.bool).tril()
        for m, i in enumerate(bucket):
            s, first, count, shared = chains[i]
            rows[m, :count] = torch.arange(first, first + count)
            if shared:
                keys[m, :shared] = trie.node_rows[s, :shared]
                mask[m, :, :shared] = True
            keys[m, pk : pk + lq] = rows[m]
        # own tokens causally (padding queries see their own row: never an empty row)
        mask[:, :, pk:] = tril
        flat = rows.reshape(-1)
        real = flat < nc
        out_idx[flat[real]] = offset + torch.nonzero(real)[:, 0]
        offset += flat.numel()
        rows_k.append(rows)
        keys_k.append(keys)
        mask_k.append(mask[:, None])
    dev = input_ids.device
    return TreePlan(
        src=src.to(dev),
        back=trie.node.to(dev),
        seg_cu=(0, nc),
        seg_len=nc,
        rows=[t.to(dev) for t in rows_k],
        keys=[t.to(dev) for t in keys_k],
        mask=[t.to(dev) for t in mask_k],
        out_index=out_idx.to(dev),
        n_stored=trie.n_nodes,
    )


def padded(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, D]`` -> ``[N + 1, H, D]``: token-major, with a zero row at index ``N``
    (the index that padding entries of a gather point at)."""
    x = x[0].transpose(0, 1)
    return torch.cat([x, x.new_zeros(1, x.shape[1], x.shape[2])])


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` ``[n, k]`` of a ``padded`` tensor as an SDPA batch ``[n, H, k, D]``."""
    n, k = idx.shape
    return x.index_select(0, idx.reshape(-1)).view(n, k, x.shape[1], x.shape[2]).transpose(1, 2)


def tree_attention(
    plan: TreePlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Attention over a :class:`TreePlan`'s layout: ``[1, H, Nc, D]`` inputs ->
    ``[1, Nc, H, D]``; each stored token attends to its ancestors and itself."""
    query, key, value = padded(query), padded(key), padded(value)
    parts = []
    for rows, keys, mask in zip(plan.rows, plan.keys, plan.mask, strict=True):
        out = F.scaled_dot_product_attention(
            gather(query, rows), gather(key, keys), gather(value, keys), attn_mask=mask,
            dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        parts.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))
    return torch.cat(parts).index_select(0, plan.out_index)[None]
