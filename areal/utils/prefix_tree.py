"""Prefix-trie packing for tree training: sequences that share leading tokens (GRPO
samples of one prompt, an agent's calls over a growing history, DPO pairs) are packed as
tries where each shared token is stored once.

:func:`pack_prefix_trees` builds the tries (greedy first-fit under a token budget),
lays every trie out depth-first (a node's tokens follow its parent's, so linear chains
sit in contiguous runs) and returns a :class:`TreePack`: the packed tokens, their
position ids (depth in the sequence), a boolean attention mask (each token sees its
ancestors and itself) and, for each sequence, the packed index of each of its tokens.
:func:`tree_forward_logprobs` runs a HuggingFace causal LM on such a pack and returns
each sequence's per-token log-probabilities, equal to the flat (one sequence at a time)
forward up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TreePack:
    """One or more packed prefix tries.

    ``input_ids`` ``[N]``: one entry per distinct trie node; ``position_ids`` ``[N]``: the
    node's depth (its index in every sequence through it); ``parent`` ``[N]``: the packed
    index of its parent (-1 at a root); ``attention_mask`` ``[N, N]`` bool: row ``i``
    is True at ``i`` and its ancestors; ``seq_ids``: the indices (into the sequences given
    to :func:`pack_prefix_trees`) of the sequences in this pack, ascending;
    ``seq_index[k]`` ``[len]``: packed index of each token of sequence ``seq_ids[k]``;
    ``tree_of[k]``: the trie (0-based, in layout order) holding it; ``tree_bounds``: the
    packed ranges ``(start, end)`` of each trie.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    attention_mask: torch.Tensor
    seq_ids: list[int]
    seq_index: list[torch.Tensor]
    tree_of: list[int]
    tree_bounds: list[tuple[int, int]]

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())


class _Trie:
    def __init__(self) -> None:
        self.children: list[dict[int, int]] = [{}]  # node 0: virtual root
        self.token: list[int] = [-1]
        self.parent: list[int] = [-1]

    def new_nodes(self, seq: list[int]) -> int:
        """How many nodes inserting ``seq`` would add."""
        node = 0
        for k, tok in enumerate(seq):
            nxt = self.children[node].get(tok)
            if nxt is None:
                return len(seq) - k
            node = nxt
        return 0

    def insert(self, seq: list[int]) -> list[int]:
        node, path = 0, []
        for tok in seq:
            nxt = self.children[node].get(tok)
            if nxt is None:
                nxt = len(self.token)
                self.children[node][tok] = nxt
                self.children.append({})
                self.token.append(tok)
                self.parent.append(node)
            node = nxt
            path.append(node)
        return path

    @property
    def size(self) -> int:
        return len(self.token) - 1


def pack_prefix_trees(
    seqs: list[list[int]], max_tokens: int | None = None, device: torch.device | str = "cpu"
) -> list[TreePack]:
    """Pack ``seqs`` into prefix tries, greedy first-fit: each sequence (in order) joins the
    first trie whose node count stays within ``max_tokens`` after adding it (shared leading
    tokens with that trie cost nothing), else starts a new trie, else a new pack. Returns
    the packs (each at most ``max_tokens`` nodes; None: one pack). A sequence longer than
    ``max_tokens`` or an empty one is an error."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1 (or None for no budget)")
    for s, seq in enumerate(seqs):
        if len(seq) == 0:
            raise ValueError(f"seqs[{s}] is empty: every sequence needs at least one token")
        if max_tokens is not None and len(seq) > max_tokens:
            raise ValueError(
                f"seqs[{s}] has {len(seq)} tokens > max_tokens={max_tokens}: raise "
                "mb_spec.max_tokens_per_mb or truncate the sequence"
            )
    budget = max_tokens if max_tokens is not None else float("inf")
    # packs: list of (tries, member sequence ids per trie)
    packs: list[tuple[list[_Trie], list[list[int]]]] = []
    for s, seq in enumerate(seqs):
        placed = False
        for tries, members in packs:
            used = sum(t.size for t in tries)
            for t, trie in enumerate(tries):
                if used + trie.new_nodes(seq) <= budget:
                    trie.insert(seq)
                    members[t].append(s)
                    placed = True
                    break
            if not placed and used + len(seq) <= budget:
                trie = _Trie()
                trie.insert(seq)
                tries.append(trie)
                members.append([s])
                placed = True
            if placed:
                break
        if not placed:
            trie = _Trie()
            trie.insert(seq)
            packs.append(([trie], [[s]]))
    return [_layout(tries, members, seqs, device) for tries, members in packs]


def _layout(
    tries: list[_Trie], members: list[list[int]], seqs: list[list[int]], device
) -> TreePack:
    tokens: list[int] = []
    depth: list[int] = []
    parent: list[int] = []
    slot: list[dict[int, int]] = []
    bounds: list[tuple[int, int]] = []
    for trie in tries:
        start = len(tokens)
        where: dict[int, int] = {}
        # depth-first, children in insertion order: a linear chain is one contiguous run
        stack = [(c, 0) for c in reversed(list(trie.children[0].values()))]
        while stack:
            node, d = stack.pop()
            where[node] = len(tokens)
            tokens.append(trie.token[node])
            depth.append(d)
            par = trie.parent[node]
            parent.append(where[par] if par != 0 else -1)
            stack.extend((c, d + 1) for c in reversed(list(trie.children[node].values())))
        slot.append(where)
        bounds.append((start, len(tokens)))
    n = len(tokens)
    par_t = torch.tensor(parent, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    # ancestors: row i = row parent(i) plus i (parents come before children)
    for i in range(n):
        p = parent[i]
        if p >= 0:
            mask[i] |= mask[p]
    index: dict[int, tuple[torch.Tensor, int]] = {}
    for t, (trie, ids) in enumerate(zip(tries, members)):
        for s in ids:
            path = _path(trie, seqs[s])
            index[s] = (torch.tensor([slot[t][v] for v in path], dtype=torch.long), t)
    seq_ids = sorted(index)
    return TreePack(
        input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
        position_ids=torch.tensor(depth, dtype=torch.long, device=device),
        parent=par_t.to(device),
        attention_mask=mask.to(device),
        seq_ids=seq_ids,
        seq_index=[index[s][0].to(device) for s in seq_ids],
        tree_of=[index[s][1] for s in seq_ids],
        tree_bounds=bounds,
    )


def _path(trie: _Trie, seq: list[int]) -> list[int]:
    node, path = 0, []
    for tok in seq:
        node = trie.children[node][tok]
        path.append(node)
    return path


def tree_forward_logits(model: nn.Module, pack: TreePack) -> torch.Tensor:
    """Logits ``[N, V]`` of ``model`` on ``pack`` (one row per trie node), attention under
    the pack's tree mask, positions = depth. The model must take a 4-D boolean
    ``attention_mask`` (HuggingFace models with ``attn_implementation='sdpa'`` or
    ``'eager'``)."""
    mask = pack.attention_mask[None, None]
    out = model(
        input_ids=pack.input_ids[None],
        position_ids=pack.position_ids[None],
        attention_mask=mask,
        use_cache=False,
    )
    return out.logits[0]


def tree_forward_logprobs(
    model: nn.Module,
    seqs: list[list[int]],
    max_tokens: int | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per-token log-probabilities of each of ``seqs`` under ``model``, computed on packed
    prefix tries: entry ``s`` is ``[len_s - 1]``, the log-probability of token ``k + 1``
    given tokens ``0..k`` (the flat path's ``logprobs[:-1]``). At a fork the children read
    the same parent row, whose output predicts whichever child follows."""
    device = next(model.parameters()).device
    packs = pack_prefix_trees(seqs, max_tokens=max_tokens, device=device)
    result: list[torch.Tensor | None] = [None] * len(seqs)
    for pack in packs:
        logits = tree_forward_logits(model, pack).float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        for s, idx in zip(pack.seq_ids, pack.seq_index):
            labels = torch.as_tensor(seqs[s][1:], device=device, dtype=torch.long)
            result[s] = logp[idx[:-1]].gather(-1, labels[:, None])[:, 0]
    return [r for r in result if r is not None]
