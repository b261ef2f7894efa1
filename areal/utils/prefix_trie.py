"""Prefix tries over packed sequences (tree training, ``actor.enable_tree_training``).

Sequences that start with the same tokens (GRPO's samples of one prompt, an agent's
calls that repeat the conversation so far, the chosen and rejected answers of a DPO/RW
pair) form a prefix trie: every distinct prefix is one *node*, stored once. With causal
attention a token's hidden state depends only on the tokens before it, so a node gives
the same activations in every sequence that passes through it.

``trie_nodes(input_ids, cu_seqlens)`` maps each packed token to its node: sequences are
inserted in order, each one following the earlier sequence it shares the most leading
tokens with (their common prefix is exactly the path already stored) and adding its
remaining tokens as new nodes, stored contiguously (a *chain*: a linear run of the trie,
handled as one block by the attention). ``pack_tries`` is the token-budget packer's
tree mode: items (sequences, or groups of ``granularity`` sequences) go greedily to the
first micro-batch whose trie stays within the budget counting the stored nodes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TrieIndex", "pack_tries", "padded_rows", "trie_nodes", "trie_size"]


def padded_rows(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """Packed ``[N]`` ids -> ``([B, L]`` rows right-padded with -1, lengths)."""
    cu = cu_seqlens.long().cpu()
    lens_t = cu[1:] - cu[:-1]
    b = lens_t.numel()
    length = int(lens_t.max()) if b else 0
    seq = torch.repeat_interleave(torch.arange(b), lens_t)
    flat = seq * length + (torch.arange(int(cu[-1])) - cu[:-1][seq])
    pad = torch.full((b * length,), -1, dtype=torch.long)
    pad[flat] = input_ids.cpu().long()
    return pad.view(b, length), lens_t.tolist()


def _lcp(
    pad: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor, s: int, n_s: int
) -> torch.Tensor:
    """Leading tokens row ``s`` shares with each row of ``rows`` (capped at both lengths)."""
    eq = (pad[rows] == pad[s]).cumprod(1).sum(1)
    return torch.minimum(eq, torch.minimum(lens[rows], torch.tensor(n_s)))


@dataclass
class TrieIndex:
    """The trie of a micro-batch's sequences.

    ``node`` ``[N]``: the node of each packed token (nodes numbered in storage order,
    every ancestor before its descendants); ``n_nodes``: the stored token count;
    ``src`` ``[n_nodes]``: a packed index holding each node's token; ``chains``: per
    sequence with new nodes, ``(sequence, first new node, count, shared length)``, the
    shared length being the tokens it shares with earlier sequences (its ancestors in the
    trie are its first ``shared`` nodes).
    """

    node: torch.Tensor
    n_nodes: int
    src: torch.Tensor
    chains: list[tuple[int, int, int, int]]
    node_rows: torch.Tensor  # [B, L] node of each (sequence, position), -1 on padding


def trie_nodes(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> TrieIndex:
    """Insert the packed sequences into one prefix trie (a forest when they share nothing)."""
    pad, lens = padded_rows(input_ids, cu_seqlens)
    b = len(lens)
    lens_t = torch.tensor(lens)
    node_rows = torch.full_like(pad, -1)
    cu = cu_seqlens.long().cpu()
    n = 0
    chains: list[tuple[int, int, int, int]] = []
    src_parts: list[torch.Tensor] = []
    for s in range(b):
        n_s = lens[s]
        shared = 0
        if s:
            lcp = _lcp(pad, lens_t, torch.arange(s), s, n_s)
            best = int(lcp.argmax())
            shared = int(lcp[best])
            node_rows[s, :shared] = node_rows[best, :shared]
        new = n_s - shared
        node_rows[s, shared:n_s] = torch.arange(n, n + new)
        if new:
            chains.append((s, n, new, shared))
            start = int(cu[s])
            src_parts.append(torch.arange(start + shared, start + n_s))
        n += new
    flat_valid = node_rows >= 0
    node = node_rows[flat_valid]
    src = torch.cat(src_parts) if src_parts else torch.zeros(0, dtype=torch.long)
    dev = input_ids.device
    return TrieIndex(
        node=node.to(dev), n_nodes=n, src=src.to(dev), chains=chains, node_rows=node_rows
    )


def trie_size(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    """``trie_nodes(...).n_nodes`` without building the trie: the number of distinct
    prefixes, i.e. all tokens minus the leading tokens each sequence shares with the one
    before it in lexicographic order (the longest prefix it shares with any other)."""
    pad, lens = padded_rows(input_ids, cu_seqlens)
    if len(lens) < 2:
        return sum(lens)
    order = sorted(range(len(lens)), key=pad[:, : max(lens)].tolist().__getitem__)
    rows = pad[torch.tensor(order)]
    lens_o = torch.tensor(lens)[torch.tensor(order)]
    lcp = (rows[1:] == rows[:-1]).cumprod(1).sum(1)
    lcp = torch.minimum(lcp, torch.minimum(lens_o[1:], lens_o[:-1]))
    return int(lens_o.sum() - lcp.sum())


def pack_tries(
    pad: torch.Tensor, lens: list[int], capacity: int, granularity: int = 1
) -> tuple[list[list[int]], list[int]]:
    """Greedy first-fit of items (runs of ``granularity`` rows) into tries of at most
    ``capacity`` stored tokens. Returns the bins (item indices, increasing) and each
    bin's stored token count. Raises ``ValueError`` when one item alone needs more."""
    lens_t = torch.tensor(lens)
    n_items = len(lens) // granularity
    bins: list[list[int]] = []
    members: list[list[int]] = []  # rows already in each bin
    loads: list[int] = []

    def added(rows: list[int], item: int) -> int:
        extra, seen = 0, list(rows)
        for s in range(item * granularity, (item + 1) * granularity):
            share = 0
            if seen:
                share = int(_lcp(pad, lens_t, torch.tensor(seen), s, lens[s]).max())
            extra += lens[s] - share
            seen.append(s)
        return extra

    for item in range(n_items):
        rows = list(range(item * granularity, (item + 1) * granularity))
        for k in range(len(bins)):
            extra = added(members[k], item)
            if loads[k] + extra <= capacity:
                bins[k].append(item)
                members[k].extend(rows)
                loads[k] += extra
                break
        else:
            own = added([], item)
            if own > capacity:
                raise ValueError(
                    f"a sequence group needs {own} trie tokens > mb_spec.max_tokens_per_mb="
                    f"{capacity}; raise max_tokens_per_mb or shorten the sequences"
                )
            bins.append([item])
            members.append(rows)
            loads.append(own)
    return bins, loads
