"""First-fit-decreasing micro-batch allocation."""

from __future__ import annotations

import random

import pytest

from areal.utils.seqpack import balanced_allocate, ffd_allocate


def _check_partition(bins, values, capacity):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(values)))
    assert all(b for b in bins)
    assert all(sum(values[i] for i in b) <= capacity for b in bins)


def test_ffd_allocate_random_inputs_valid_partition_under_capacity():
    rng = random.Random(0)
    for _ in range(200):
        values = [rng.randint(1, 100) for _ in range(rng.randint(1, 40))]
        cap = rng.randint(100, 300)
        bins = ffd_allocate(values, cap)
        _check_partition(bins, values, cap)
        # FFD never needs more than ~11/9 OPT + 1 bins; it is at least the lower bound
        assert len(bins) >= -(-sum(values) // cap)
        assert len(bins) <= 11 * (-(-sum(values) // cap)) // 9 + 2


def test_ffd_allocate_known_case_packs_tightly():
    bins = ffd_allocate([60, 40, 30, 70, 50, 50], 100)
    assert len(bins) == 3
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2, 3], [4, 5]]


def test_ffd_allocate_min_groups_gives_balanced_nonempty_bins():
    values = [10, 10, 10, 10, 10, 10]
    bins = ffd_allocate(values, 1000, min_groups=3)
    _check_partition(bins, values, 1000)
    assert len(bins) == 3 and all(len(b) == 2 for b in bins)


def test_ffd_allocate_divisor_rounds_bin_count_up():
    values = [50, 50, 50, 10, 10]
    bins = ffd_allocate(values, 100, divisor=4)
    _check_partition(bins, values, 100)
    assert len(bins) % 4 == 0


def test_ffd_allocate_item_over_capacity_raises():
    with pytest.raises(ValueError, match="size 120 > capacity 100"):
        ffd_allocate([10, 120], 100)


def test_ffd_allocate_fewer_items_than_groups_raises():
    with pytest.raises(ValueError, match="at least 3"):
        ffd_allocate([10, 20], 100, min_groups=3)


def test_balanced_allocate_opens_extra_bins_when_needed():
    bins = balanced_allocate([90, 90, 90], 100, 2)
    assert len(bins) == 3
