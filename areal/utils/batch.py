"""Helpers for padded trajectory batches (dicts of tensors with a leading batch dim).

Right padding. Per-key pad values follow the shared conventions: ``versions`` pads with
-1, everything else with ``pad_value`` (0 by default) unless ``pad_values`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["DEFAULT_PAD_VALUES", "concat_padded_tensors", "pad_sequences_to_tensors"]

DEFAULT_PAD_VALUES: dict[str, int | float] = {"versions": -1}


def _pad_for(key: str, pad_value: int | float, pad_values: Mapping[str, Any] | None) -> Any:
    if pad_values is not None and key in pad_values:
        return pad_values[key]
    return DEFAULT_PAD_VALUES.get(key, pad_value)


def concat_padded_tensors(
    tensor_dicts: Sequence[Mapping[str, Any]],
    pad_value: int | float = 0,
    pad_values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Concatenate padded batches along dim 0, right-padding dim 1 to the longest.

    Tensors with ``ndim >= 2`` are padded on dim 1; 1-D tensors (per-sequence values such
    as ``rewards``) are concatenated; 0-d tensors are stacked; lists are joined; any other
    value is collected into a list (one entry per input dict). All dicts must have the
    same keys.
    """
    dicts = [d for d in tensor_dicts if d is not None]
    if not dicts:
        return {}
    keys = list(dicts[0].keys())
    key_set = set(keys)
    for i, d in enumerate(dicts[1:], start=1):
        if set(d.keys()) != key_set:
            raise ValueError(
                f"concat_padded_tensors: dict {i} has keys {sorted(d.keys())}, "
                f"dict 0 has {sorted(key_set)}"
            )
    out: dict[str, Any] = {}
    for key in keys:
        values = [d[key] for d in dicts]
        first = values[0]
        if isinstance(first, torch.Tensor):
            if not all(isinstance(v, torch.Tensor) and v.ndim == first.ndim for v in values):
                raise ValueError(f"concat_padded_tensors: key {key!r} mixes tensor ranks/types")
            if first.ndim == 0:
                out[key] = torch.stack(values)
            elif first.ndim == 1:
                out[key] = torch.cat(values, dim=0)
            else:
                max_len = max(v.shape[1] for v in values)
                pad = _pad_for(key, pad_value, pad_values)
                padded = []
                for v in values:
                    if v.shape[1] < max_len:
                        shape = list(v.shape)
                        shape[1] = max_len - v.shape[1]
                        v = torch.cat([v, v.new_full(shape, pad)], dim=1)
                    padded.append(v)
                out[key] = torch.cat(padded, dim=0)
        elif isinstance(first, list):
            joined: list[Any] = []
            for v in values:
                joined.extend(v)
            out[key] = joined
        else:
            out[key] = list(values)
    return out


def pad_sequences_to_tensors(
    sequences: Sequence[Mapping[str, Any]],
    pad_value: int | float = 0,
    pad_values: Mapping[str, Any] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """Build a padded ``[B, T]`` batch from per-sequence dicts.

    Each item maps keys to 1-D sequences (lists or 1-D tensors; padded to the longest
    along T) or to scalars (numbers or 0-d tensors; stacked into ``[B]``).
    ``dtypes`` fixes the dtype per key (default: inferred by ``torch.tensor``).
    """
    if not sequences:
        return {}
    keys = list(sequences[0].keys())
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        dtype = dtypes.get(key) if dtypes else None
        vals = [s[key] for s in sequences]
        first = vals[0]
        is_scalar = isinstance(first, int | float | bool) or (
            isinstance(first, torch.Tensor) and first.ndim == 0
        )
        if is_scalar:
            out[key] = torch.tensor([float(v) if dtype is None else v for v in vals], dtype=dtype)
            continue
        tensors = [
            v.to(dtype)
            if isinstance(v, torch.Tensor) and dtype is not None
            else (v if isinstance(v, torch.Tensor) else torch.tensor(list(v), dtype=dtype))
            for v in vals
        ]
        max_len = max(t.shape[0] for t in tensors)
        pad = _pad_for(key, pad_value, pad_values)
        result = tensors[0].new_full((len(tensors), max_len), pad)
        for i, t in enumerate(tensors):
            result[i, : t.shape[0]] = t
        out[key] = result
    return out
