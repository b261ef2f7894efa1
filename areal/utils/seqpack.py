"""Bin packing of sequences into micro-batches under a token budget.

``ffd_allocate`` groups item indices into bins whose summed sizes stay under
``capacity``. It first runs first-fit decreasing (FFD: biggest item first, into the first
bin with room, else a new bin), which gives few bins. When more bins are required
(``min_groups``, or a bin count that must be a multiple of ``divisor`` such as the same
micro-batch count on every data-parallel rank), items are instead dealt biggest first to
the least-loaded bin that has room, which keeps the bins balanced.

``kk_allocate`` has the same contract but balances the bins' token counts with the
Karmarkar-Karp largest differencing method (``kk_partition``): it takes the fewest bins
the budget allows (at least ``ceil(total / capacity)``), splits the items into that many
near-equal groups, and adds bins only while a group would exceed the budget.
``get_allocate_fn(name)`` maps ``MicroBatchSpec.packing_algorithm`` (``"ffd"``/``"kk"``)
to the function.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

__all__ = [
    "PACKING_ALGORITHMS",
    "balanced_allocate",
    "ffd_allocate",
    "get_allocate_fn",
    "kk_allocate",
    "kk_partition",
    "partition_spread",
    "round_up",
]

PACKING_ALGORITHMS = ("ffd", "kk")


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


# ------------------------------------------------------------------ Karmarkar-Karp
def partition_spread(values: Sequence[int], bins: Sequence[Sequence[int]]) -> int:
    """``max - min`` of the bins' summed sizes (0 for no bins)."""
    loads = [sum(values[i] for i in b) for b in bins]
    return max(loads) - min(loads) if loads else 0


def kk_partition(values: Sequence[int], n_parts: int) -> list[list[int]]:
    """Split the indices of ``values`` into ``n_parts`` groups of near-equal total size.

    Largest differencing method (Karmarkar-Karp, k-way): every item starts as a partial
    partition with the item in one of ``n_parts`` slots; the two partial partitions with
    the largest spread (max - min slot sum) are repeatedly combined by joining the
    heaviest slot of one with the lightest of the other, the second heaviest with the
    second lightest, and so on, until one partition is left. Deterministic; every group is
    non-empty when ``len(values) >= n_parts``; indices inside a group are sorted.
    """
    if n_parts < 1:
        raise ValueError(f"n_parts={n_parts}; must be >= 1")
    if len(values) < n_parts:
        raise ValueError(f"cannot split {len(values)} item(s) into {n_parts} non-empty groups")
    if any(v < 0 for v in values):
        raise ValueError("kk_partition needs non-negative sizes")
    tie = itertools.count()
    # Heap entries: (-spread, tie, slots). ``slots`` lists only the non-empty slots,
    # heaviest first; the other ``n_parts - len(slots)`` slots are empty (sum 0).
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = [
        (-values[i], next(tie), [(values[i], [i])]) for i in _decreasing(values)
    ]
    heapq.heapify(heap)
    k = n_parts
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # slot i of a (heaviest first) joins slot k-1-i of b (lightest first)
        merged = []
        for i in itertools.chain(range(len(a)), range(max(len(a), k - len(b)), k)):
            sa, ia = a[i] if i < len(a) else (0, [])
            j = k - 1 - i
            sb, ib = b[j] if j < len(b) else (0, [])
            merged.append((sa + sb, ia + ib))
        merged.sort(key=lambda s: -s[0])
        lightest = merged[-1][0] if len(merged) == k else 0
        heapq.heappush(heap, (lightest - merged[0][0], next(tie), merged))
    slots = heap[0][2]
    groups = [sorted(items) for _, items in slots] + [[] for _ in range(k - len(slots))]
    _fill_empty(groups, values)
    return groups


def _fill_empty(groups: list[list[int]], values: Sequence[int]) -> None:
    """Give every empty group the smallest item of the group with the most items
    (only zero-size items can leave a group empty)."""
    for g in groups:
        if g:
            continue
        donor = max(groups, key=len)
        j = min(donor, key=lambda i: values[i])
        donor.remove(j)
        g.append(j)


def kk_allocate(
    values: Sequence[int], capacity: int, min_groups: int = 1, divisor: int = 1
) -> list[list[int]]:
    """Same contract as :func:`ffd_allocate`, with bins balanced by Karmarkar-Karp.

    The bin count starts at ``max(min_groups, ceil(sum / capacity))`` rounded up to a
    multiple of ``divisor``; the items are split into that many groups by
    :func:`kk_partition` (or by the greedy split of :func:`balanced_allocate` when that
    one is more even), and the count grows by ``divisor`` while a group exceeds
    ``capacity``. It never uses more bins than first-fit decreasing: at FFD's bin count
    the most even of the KK, greedy and FFD packings that fit is returned, so the
    result's spread (max - min tokens) is never above FFD's at the same bin count.
    """
    if divisor < 1:
        raise ValueError(f"divisor={divisor}; must be >= 1")
    _check(values, capacity, min_groups)
    k = round_up(max(min_groups, -(-sum(values) // capacity), 1), divisor)
    ffd_bins = ffd_allocate(values, capacity, min_groups, divisor)
    while k < len(ffd_bins):
        # KK is a heuristic: on some inputs the greedy split (biggest item to the lightest
        # bin) is more even, so the more even of the two is kept when it fits.
        fitting = [
            g
            for g in (kk_partition(values, k), balanced_allocate(values, capacity, k))
            if len(g) == k and all(sum(values[i] for i in b) <= capacity for b in g)
        ]
        if fitting:
            return min(fitting, key=lambda g: partition_spread(values, g))
        k += divisor
    # as many bins as FFD needs: FFD's own packing is a candidate too
    candidates = [ffd_bins, kk_partition(values, len(ffd_bins))]
    candidates.append(balanced_allocate(values, capacity, len(ffd_bins)))
    fitting = [
        g
        for g in candidates
        if len(g) == len(ffd_bins) and all(sum(values[i] for i in b) <= capacity for b in g)
    ]
    return min(fitting, key=lambda g: partition_spread(values, g))


def get_allocate_fn(algorithm: str | None = "ffd") -> Callable[..., list[list[int]]]:
    """The allocation function named by ``MicroBatchSpec.packing_algorithm`` (None: ffd)."""
    if algorithm is None or algorithm == "ffd":
        return ffd_allocate
    if algorithm == "kk":
        return kk_allocate
    raise ValueError(f"packing_algorithm={algorithm!r}; allowed: {list(PACKING_ALGORITHMS)}")
