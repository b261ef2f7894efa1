"""Bin packing of sequences into micro-batches under a token budget.

``ffd_allocate`` groups item indices into bins whose summed sizes stay under
``capacity``. It first runs first-fit decreasing (FFD: biggest item first, into the first
bin with room, else a new bin), which gives few bins. When more bins are required
(``min_groups``, or a bin count that must be a multiple of ``divisor`` such as the same
micro-batch count on every data-parallel rank), items are instead dealt biggest first to
the least-loaded bin that has room, which keeps the bins balanced.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ffd_allocate", "balanced_allocate", "round_up"]


def round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


def _check(values: Sequence[int], capacity: int, min_groups: int) -> None:
    if capacity <= 0:
        raise ValueError(f"capacity={capacity}; must be > 0")
    if min_groups < 1:
        raise ValueError(f"min_groups={min_groups}; must be >= 1")
    if len(values) < min_groups:
        raise ValueError(
            f"cannot split {len(values)} item(s) into at least {min_groups} non-empty groups"
        )
    too_big = [(i, v) for i, v in enumerate(values) if v > capacity]
    if too_big:
        i, v = too_big[0]
        raise ValueError(
            f"item {i} has size {v} > capacity {capacity} "
            f"({len(too_big)} item(s) exceed the capacity; raise max_tokens_per_mb)"
        )


def _decreasing(values: Sequence[int]) -> list[int]:
    # Stable: equal sizes keep their original order, so the result is deterministic.
    return sorted(range(len(values)), key=lambda i: -values[i])


def balanced_allocate(values: Sequence[int], capacity: int, n_groups: int) -> list[list[int]]:
    """Deal items (biggest first) to the least-loaded of ``n_groups`` bins that has room.

    Opens extra bins only when no bin has room, so the result has ``>= n_groups`` bins,
    all non-empty when ``len(values) >= n_groups``. Indices inside a bin are sorted.
    """
    _check(values, capacity, n_groups)
    bins: list[list[int]] = [[] for _ in range(n_groups)]
    loads = [0] * n_groups
    for i in _decreasing(values):
        v = values[i]
        best = -1
        for b, load in enumerate(loads):
            if load + v <= capacity and (best < 0 or load < loads[best]):
                best = b
        if best < 0:
            bins.append([i])
            loads.append(v)
        else:
            bins[best].append(i)
            loads[best] += v
    return [sorted(b) for b in bins]


def ffd_allocate(
    values: Sequence[int], capacity: int, min_groups: int = 1, divisor: int = 1
) -> list[list[int]]:
    """Group the indices of ``values`` into bins of total size ``<= capacity``.

    Returns at least ``min_groups`` non-empty bins, their count a multiple of ``divisor``;
    each bin lists its item indices in increasing order. Raises ``ValueError`` when an
    item alone exceeds ``capacity`` or there are fewer items than bins required.
    """
    if divisor < 1:
        raise ValueError(f"divisor={divisor}; must be >= 1")
    _check(values, capacity, min_groups)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _decreasing(values):
        v = values[i]
        for b, load in enumerate(loads):
            if load + v <= capacity:
                bins[b].append(i)
                loads[b] += v
                break
        else:
            bins.append([i])
            loads.append(v)
    if len(bins) >= min_groups and len(bins) % divisor == 0:
        return [sorted(b) for b in bins]
    k = round_up(max(min_groups, len(bins)), divisor)
    while True:
        if k > len(values):
            raise ValueError(
                f"cannot split {len(values)} item(s) into a multiple of {divisor} groups "
                f"(at least {max(min_groups, len(bins))} needed)"
            )
        out = balanced_allocate(values, capacity, k)
        if len(out) % divisor == 0:
            return out
        k = round_up(len(out), divisor)
