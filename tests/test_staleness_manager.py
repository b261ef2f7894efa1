import threading

import pytest

from areal.infra.staleness_manager import RolloutStat, StalenessManager


def _run(sm: StalenessManager, n_accept: int = 0, n_running: int = 0) -> None:
    for _ in range(n_accept + n_running):
        sm.on_rollout_enqueued()
        sm.on_rollout_submitted()
    for _ in range(n_accept):
        sm.on_rollout_accepted()


def test_capacity_fresh_manager_is_min_of_concurrency_and_staleness():
    sm = StalenessManager(max_concurrent_rollouts=100, consumer_batch_size=4, max_staleness=2)
    assert sm.get_capacity(0) == (2 + 0 + 1) * 4
    sm = StalenessManager(max_concurrent_rollouts=5, consumer_batch_size=4, max_staleness=2)
    assert sm.get_capacity(0) == 5


def test_capacity_counts_accepted_and_running_against_staleness_bound():
    sm = StalenessManager(max_concurrent_rollouts=100, consumer_batch_size=4, max_staleness=1)
    _run(sm, n_accept=3, n_running=2)
    # (1 + 0 + 1) * 4 - (3 + 2) = 3
    assert sm.get_capacity(0) == 3
    # version bump opens one more batch
    assert sm.get_capacity(1) == 7


def test_capacity_synchronous_eta0_allows_exactly_one_batch_per_version():
    sm = StalenessManager(max_concurrent_rollouts=100, consumer_batch_size=3, max_staleness=0)
    assert sm.get_capacity(0) == 3
    _run(sm, n_accept=3)
    assert sm.get_capacity(0) == 0
    assert sm.get_capacity(1) == 3


def test_capacity_concurrency_limited_by_running():
    sm = StalenessManager(max_concurrent_rollouts=2, consumer_batch_size=8, max_staleness=4)
    _run(sm, n_running=2)
    assert sm.get_capacity(0) == 0
    sm.on_rollout_rejected()
    assert sm.get_capacity(0) == 1


def test_capacity_with_version_provider_object_and_callable():
    class Engine:
        v = 2

        def get_version(self):
            return self.v

    sm = StalenessManager(4, 2, 0, version_provider=Engine())
    assert sm.get_capacity() == min(4, (0 + 2 + 1) * 2)
    sm2 = StalenessManager(100, 2, 1, version_provider=lambda: 5)
    assert sm2.get_capacity() == (1 + 5 + 1) * 2


def test_capacity_without_version_raises_clear_error():
    sm = StalenessManager(4, 2, 0)
    with pytest.raises(ValueError, match="current_version"):
        sm.get_capacity()


def test_negative_staleness_rejected():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(4, 2, -1)


def test_stats_track_lifecycle_counters():
    sm = StalenessManager(10, 2, 1)
    for _ in range(4):
        sm.on_rollout_enqueued()
    sm.on_rollout_submitted()
    sm.on_rollout_submitted()
    sm.on_rollout_submitted()
    sm.on_rollout_accepted()
    sm.on_rollout_rejected()
    assert sm.get_stats() == RolloutStat(enqueued=1, running=1, accepted=1, rejected=1)
    sm.on_rollout_discarded()
    assert sm.get_stats() == RolloutStat(enqueued=1, running=1, accepted=0, rejected=2)


def test_version_recovered_resets_accepted_so_resume_does_not_burst():
    sm = StalenessManager(max_concurrent_rollouts=1000, consumer_batch_size=4, max_staleness=1)
    # fresh counters at version 10 would allow (1 + 10 + 1) * 4 = 48 rollouts
    assert sm.get_capacity(10) == 48
    sm.on_version_recovered(10)
    assert sm.get_stats().accepted == 40
    assert sm.get_capacity(10) == 8  # only (eta + 1) batches ahead


def test_refused_syncs_count_as_versions_while_the_version_stays():
    sm = StalenessManager(max_concurrent_rollouts=1000, consumer_batch_size=4, max_staleness=0)
    sm.on_version_recovered(3)  # three batches consumed, weights at version 3
    assert sm.get_capacity(3) == 4
    for _ in range(4):
        sm.on_rollout_submitted()
        sm.on_rollout_accepted()
    assert sm.get_capacity(3) == 0  # the batch is consumed; its sync is refused twice:
    sm.on_sync_refused(3)
    assert sm.get_capacity(3) == 4
    sm.on_sync_refused(3)
    assert sm.get_capacity(3) == 8
    assert sm.get_capacity(4) == 4  # another version: the credit is gone
    sm.on_sync_refused(4)  # a refusal at a new version starts a new count
    assert sm.get_capacity(4) == 8 and sm.get_capacity(3) == 0
    sm.on_version_recovered(4)  # a resume or rollback clears it
    assert sm.get_capacity(4) == 4


def test_counters_are_thread_safe_under_concurrent_updates():
    sm = StalenessManager(10**9, 1, 10**9)
    n_threads, n_iter = 8, 2000

    def worker():
        for _ in range(n_iter):
            sm.on_rollout_enqueued()
            sm.on_rollout_submitted()
            sm.on_rollout_accepted()

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = sm.get_stats()
    assert s == RolloutStat(enqueued=0, running=0, accepted=n_threads * n_iter, rejected=0)
