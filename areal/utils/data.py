"""Padded <-> packed tensor dicts and micro-batch splitting.

Layouts
-------
*Padded*: ``input_ids``/``attention_mask`` ``[B, T]`` with right padding (1 = real token),
other per-token keys ``[B, T, ...]``, per-sequence keys ``[B, ...]``.

*Packed*: padding dropped and sequences concatenated: per-token keys ``[N, ...]`` with
``N = attention_mask.sum()``, per-sequence keys unchanged ``[B, ...]``, plus
``cu_seqlens`` (int32 ``[B + 1]``), ``max_seqlen`` (int) and ``position_ids`` (``[N]``,
restarting at 0 for every sequence). ``attention_mask`` is not carried into the packed
dict. A key is per-token when its first two dims equal ``attention_mask``'s shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from areal.utils.batch import concat_padded_tensors  # noqa: F401  (re-exported)
from areal.utils.seqpack import get_allocate_fn

__all__ = [
    "MicroBatchList",
    "concat_padded_tensors",
    "get_seqlens",
    "is_per_token",
    "pack_tensor_dict",
    "pad_packed_tensor",
    "select_sequences",
    "split_padded_tensor_dict_into_mb_list",
    "unpack_sequence",
    "validate_padded_batch",
]


def validate_padded_batch(data: dict[str, Any], name: str = "batch") -> torch.Tensor:
    """Check a padded batch and return its sequence lengths ``[B]`` (long).

    Raises ``ValueError`` naming the problem: missing ``attention_mask``/``input_ids``,
    wrong ranks or shapes, padding that is not right padding, or an empty sequence.
    """
    if not isinstance(data, dict):
        raise TypeError(f"{name} must be a dict of tensors, got {type(data).__name__}")
    if "attention_mask" not in data:
        raise ValueError(
            f"{name} has no 'attention_mask' (keys: {sorted(data)}); a padded batch needs "
            "attention_mask [B, T] with 1 on real tokens"
        )
    if "input_ids" not in data:
        raise ValueError(f"{name} has no 'input_ids' (keys: {sorted(data)})")
    mask, ids = data["attention_mask"], data["input_ids"]
    if not torch.is_tensor(mask) or mask.dim() != 2:
        raise ValueError(
            f"{name}['attention_mask'] must be a 2-D tensor [B, T], got {_shape(mask)}"
        )
    if not torch.is_tensor(ids) or tuple(ids.shape) != tuple(mask.shape):
        raise ValueError(
            f"{name}['input_ids'] shape {_shape(ids)} != attention_mask shape {tuple(mask.shape)}"
        )
    lens = get_seqlens(mask)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] < lens[:, None]
    if not torch.equal(mask.bool(), expected):
        raise ValueError(
            f"{name}['attention_mask'] is not right-padded (each row must be 1...1 0...0)"
        )
    if mask.shape[0] > 0 and bool((lens == 0).any()):
        raise ValueError(f"{name} contains an empty sequence (attention_mask row of zeros)")
    return lens


def _shape(x: Any) -> Any:
    return tuple(x.shape) if torch.is_tensor(x) else type(x).__name__


def get_seqlens(attention_mask: torch.Tensor) -> torch.Tensor:
    return attention_mask.bool().sum(dim=1).long()


def is_per_token(value: Any, mask_shape: Sequence[int]) -> bool:
    return (
        torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(mask_shape)
    )


def pack_tensor_dict(data: dict[str, Any]) -> dict[str, Any]:
    """Padded -> packed (see module docstring). Non-tensor values are passed through."""
    lens = validate_padded_batch(data)
    mask = data["attention_mask"].bool()
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k == "attention_mask":
            continue
        out[k] = v[mask] if is_per_token(v, mask.shape) else v
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = lens.cumsum(0)
    n = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1].long(), lens)
    out["cu_seqlens"] = cu
    out["max_seqlen"] = int(lens.max()) if lens.numel() else 0
    out["position_ids"] = torch.arange(n, device=mask.device) - starts
    return out


def unpack_sequence(x: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed ``[N, ...]`` tensor into its per-sequence pieces."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(x, lens, dim=0))


def pad_packed_tensor(
    x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int | None = None, pad_value: float = 0
) -> torch.Tensor:
    """Packed ``[N, ...]`` -> right-padded ``[B, max_len, ...]``."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    t = int(lens.max()) if max_len is None and lens.numel() else (max_len or 0)
    mask = torch.arange(t, device=x.device)[None, :] < lens.to(x.device)[:, None]
    out = x.new_full((lens.numel(), t, *x.shape[1:]), pad_value)
    out[mask] = x
    return out


def select_sequences(
    data: dict[str, Any], indices: Sequence[int] | torch.Tensor, trim: bool = True
) -> dict[str, Any]:
    """Padded sub-batch of the rows ``indices`` (trimmed to its longest sequence)."""
    mask = data["attention_mask"]
    b = mask.shape[0]
    idx = torch.as_tensor(indices, dtype=torch.long, device=mask.device)
    t = mask.shape[1]
    if trim and idx.numel():
        t = int(get_seqlens(mask[idx]).max())
    out: dict[str, Any] = {}
    for k, v in data.items():
        if is_per_token(v, mask.shape):
            out[k] = v[idx, :t]
        elif torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == b:
            out[k] = v[idx]
        elif isinstance(v, list) and len(v) == b:  # per-row values (multi_modal_input)
            out[k] = [v[i] for i in idx.tolist()]
        else:
            out[k] = v
    return out


@dataclass
class MicroBatchList:
    """A padded batch split into micro-batches.

    ``mbs[i]`` is the padded sub-batch made of the original rows ``group_indices[i]``;
    ``forward_indices`` is their concatenation and ``backward_indices`` its inverse
    permutation: ``concat(results)[backward_indices]`` restores the original row order.
    """

    data: dict[str, Any]
    mbs: list[dict[str, Any]]
    group_indices: list[list[int]]
    forward_indices: torch.Tensor
    backward_indices: torch.Tensor
    mb_token_counts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.mbs)

    def packed(self) -> list[dict[str, Any]]:
        return [pack_tensor_dict(mb) for mb in self.mbs]


def _spec_value(mb_spec: Any, name: str, default: Any) -> Any:
    v = getattr(mb_spec, name, default) if mb_spec is not None else default
    return default if v is None else v


def _all_reduce_max(values: list[int], group: dist.ProcessGroup) -> list[int]:
    t = torch.tensor(values, dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _tree_allocate_fn(data: dict[str, Any], lens: torch.Tensor, granularity: int, fallback: Any):
    """An allocate function (``ffd_allocate``'s contract) whose bins are prefix tries:
    greedy first-fit of the sequence groups, the budget counting stored trie tokens
    (``pack_tries``). More bins when required (``min_groups``, ``divisor``): the budget
    shrinks until there are enough, else the plain allocator on raw lengths."""
    from areal.utils.prefix_trie import pack_tries

    mask = data["attention_mask"].bool().cpu()
    pad = torch.where(
        mask, data["input_ids"].cpu().long(), torch.full_like(mask, -1, dtype=torch.long)
    )
    lens_l = lens.tolist()

    def allocate(values, capacity, min_groups=1, divisor=1):
        cap = int(capacity)
        while True:
            bins, _ = pack_tries(pad, lens_l, cap, granularity)
            if len(bins) >= min_groups and len(bins) % divisor == 0:
                return bins
            smaller = int(cap * 0.8)
            if len(bins) >= len(values) or smaller < 1:
                return fallback(values, capacity, min_groups=min_groups, divisor=divisor)
            try:
                pack_tries(pad, lens_l, smaller, granularity)
            except ValueError:
                return fallback(values, capacity, min_groups=min_groups, divisor=divisor)
            cap = smaller

    return allocate


def _plan_bins(
    data: dict[str, Any], mb_spec: Any, name: str, tree: bool = False
) -> tuple[list[int], int, list[list[int]]]:
    lens = validate_padded_batch(data, name)
    n_mbs = int(_spec_value(mb_spec, "n_mbs", 1))
    granularity = int(_spec_value(mb_spec, "granularity", 1))
    max_tokens = int(_spec_value(mb_spec, "max_tokens_per_mb", 1 << 62))
    divisor = int(_spec_value(mb_spec, "n_mbs_divisor", 1))
    b = lens.numel()
    if b == 0:
        raise ValueError(f"cannot split an empty {name} (B = 0) into micro-batches")
    if granularity < 1 or b % granularity:
        raise ValueError(f"{name} size {b} is not a multiple of mb_spec.granularity={granularity}")
    group_lens = lens.view(-1, granularity).sum(1).tolist()
    longest = max(group_lens)
    allocate = get_allocate_fn(_spec_value(mb_spec, "packing_algorithm", "ffd"))
    if tree:  # tries are the packing unit: the budget counts stored trie tokens
        allocate = _tree_allocate_fn(data, lens, granularity, allocate)
    elif longest > max_tokens:
        what = "sequence" if granularity == 1 else f"group of {granularity} sequences"
        raise ValueError(
            f"a {what} of {name} has {longest} tokens > mb_spec.max_tokens_per_mb={max_tokens}; "
            "raise max_tokens_per_mb or shorten the sequences"
        )
    if n_mbs > len(group_lens):
        raise ValueError(
            f"mb_spec.n_mbs={n_mbs} micro-batches requested but {name} has only "
            f"{len(group_lens)} sequence group(s)"
        )
    bins = allocate(group_lens, max_tokens, min_groups=n_mbs, divisor=divisor)
    return group_lens, granularity, bins


def split_padded_tensor_dict_into_mb_list(
    data: dict[str, Any],
    mb_spec: Any = None,
    group: dist.ProcessGroup | None = None,
    name: str = "batch",
    tree: bool = False,
) -> MicroBatchList:
    """Split a padded batch into micro-batches of at most ``mb_spec.max_tokens_per_mb`` tokens.

    Sequences are grouped in consecutive runs of ``mb_spec.granularity`` rows that stay
    together; groups are packed into at least ``mb_spec.n_mbs`` micro-batches, a multiple
    of ``mb_spec.n_mbs_divisor``, by ``mb_spec.packing_algorithm``: ``"ffd"`` (first-fit
    decreasing: fewest micro-batches) or ``"kk"`` (Karmarkar-Karp: the fewest the budget
    allows, with near-equal token counts; see :func:`areal.utils.seqpack.kk_allocate`).
    With ``group`` (a
    data-parallel process group) every rank ends up with the same number of micro-batches
    (the maximum over ranks), as FSDP needs matching collectives on every rank; a bad
    batch on any rank makes every rank raise ``ValueError`` (no rank is left waiting).
    With ``tree`` (tree training) the micro-batches are prefix tries: groups are packed
    greedily, first fit, and the budget counts each shared token once.
    """
    multi = group is not None and dist.get_world_size(group) > 1
    if not multi:
        group_lens, granularity, bins = _plan_bins(data, mb_spec, name, tree)
    else:
        err: ValueError | None = None
        try:
            group_lens, granularity, bins = _plan_bins(data, mb_spec, name, tree)
        except ValueError as e:
            err, group_lens, granularity, bins = e, [], 1, []
        any_err, k, neg_min_groups = _all_reduce_max(
            [int(err is not None), len(bins), -len(group_lens)], group
        )
        if err is not None:
            raise err
        if any_err:
            raise ValueError(f"another data-parallel rank rejected its {name} (see its error)")
        if k > -neg_min_groups:
            raise ValueError(
                f"a data-parallel rank needs {k} micro-batches but another rank has only "
                f"{-neg_min_groups} sequence group(s); give every rank a larger batch or raise "
                "max_tokens_per_mb"
            )
        max_tokens = int(_spec_value(mb_spec, "max_tokens_per_mb", 1 << 62))
        divisor = int(_spec_value(mb_spec, "n_mbs_divisor", 1))
        allocate = get_allocate_fn(_spec_value(mb_spec, "packing_algorithm", "ffd"))
        if tree and group_lens:
            allocate = _tree_allocate_fn(
                data, validate_padded_batch(data, name), granularity, allocate
            )
        # Every rank must run the same number of micro-batches (FSDP collectives).
        while True:
            if len(bins) != k:
                bins = allocate(group_lens, max_tokens, min_groups=k, divisor=divisor)
            (n,) = _all_reduce_max([len(bins)], group)
            if n == k:
                break
            k = n
    group_indices = [
        [g * granularity + j for g in bin_ for j in range(granularity)] for bin_ in bins
    ]
    fwd = torch.tensor([i for g in group_indices for i in g], dtype=torch.long)
    bwd = torch.empty_like(fwd)
    bwd[fwd] = torch.arange(fwd.numel())
    mbs = [select_sequences(data, g) for g in group_indices]
    counts = [sum(group_lens[g] for g in bin_) for bin_ in bins]
    return MicroBatchList(
        data=data,
        mbs=mbs,
        group_indices=group_indices,
        forward_indices=fwd,
        backward_indices=bwd,
        mb_token_counts=counts,
    )
