"""Tests for areal.utils.stats_tracker."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal.utils import stats_tracker
from areal.utils.stats_tracker import DistributedStatsTracker, ReduceType


def test_stat_masked_values_exports_masked_avg_min_max():
    t = DistributedStatsTracker()
    mask = torch.tensor([[True, False, True], [False, True, False]])
    vals = torch.tensor([[1.0, 100.0, 3.0], [-100.0, 5.0, 7.0]])
    with t.scope("actor"):
        t.denominator(n_tokens=mask)
        t.stat(x=vals, denominator="n_tokens")
    out = t.export()
    assert out["actor/n_tokens"] == 3
    assert out["actor/x/avg"] == pytest.approx(3.0)
    assert out["actor/x/min"] == 1.0
    assert out["actor/x/max"] == 5.0


def test_stat_multiple_records_pool_over_all_masked_entries():
    t = DistributedStatsTracker()
    t.denominator(m=torch.tensor([True, True]))
    t.stat(x=torch.tensor([1.0, 2.0]), denominator="m")
    t.denominator(m=torch.tensor([True, False, True, True]))
    t.stat(x=torch.tensor([10.0, -50.0, 20.0, 30.0]), denominator="m")
    out = t.export()
    # pooled token mean (not mean of means): (1+2+10+20+30)/5
    assert out["x/avg"] == pytest.approx(63.0 / 5)
    assert out["x/min"] == 1.0 and out["x/max"] == 30.0
    assert out["m"] == 5


def test_stat_reduce_types_single_keys():
    t = DistributedStatsTracker()
    t.denominator(m=torch.tensor([True, True, False]))
    v = torch.tensor([2.0, 4.0, 9.0])
    t.stat(a=v, denominator="m", reduce_type=ReduceType.AVG)
    t.stat(s=v, denominator="m", reduce_type=ReduceType.SUM)
    t.stat(lo=v, denominator="m", reduce_type=ReduceType.MIN)
    t.stat(hi=v, denominator="m", reduce_type=ReduceType.MAX)
    out = t.export()
    assert out["a"] == 3.0 and out["s"] == 6.0 and out["lo"] == 2.0 and out["hi"] == 4.0


def test_scalar_and_timing_export_mean_and_count():
    t = DistributedStatsTracker()
    t.scalar(lr=1.0)
    t.scalar(lr=3.0)
    with t.scope("x"), t.record_timing("step"):
        pass
    out = t.export()
    assert out["lr"] == 2.0 and out["lr__count"] == 2
    assert "timeperf/step" in out and out["timeperf/step"] >= 0.0


def test_export_reset_true_clears_and_false_keeps():
    t = DistributedStatsTracker()
    t.scalar(a=1.0)
    assert t.export(reset=False) == {"a": 1.0, "a__count": 1}
    assert t.export() == {"a": 1.0, "a__count": 1}
    assert t.export() == {}


def test_stat_all_masked_out_key_omitted():
    t = DistributedStatsTracker()
    t.denominator(m=torch.tensor([False, False]))
    t.stat(x=torch.tensor([1.0, 2.0]), denominator="m")
    out = t.export()
    assert out == {"m": 0.0}


def test_stat_missing_denominator_or_bad_dtype_raises():
    t = DistributedStatsTracker()
    with pytest.raises(ValueError, match="denominator"):
        t.stat(x=torch.tensor([1.0]), denominator="nope")
    with pytest.raises(ValueError, match="bool"):
        t.denominator(m=torch.tensor([1, 0]))
    t.denominator(m=torch.tensor([True]))
    with pytest.raises(ValueError, match="float"):
        t.stat(x=torch.tensor([1]), denominator="m")
    with pytest.raises(ValueError, match="shape"):
        t.stat(x=torch.tensor([1.0, 2.0]), denominator="m")


def test_get_named_tracker_prefixes_keys_and_is_cached():
    r = stats_tracker.get("rollout_test")
    assert stats_tracker.get("rollout_test") is r
    assert stats_tracker.get() is stats_tracker.DEFAULT_TRACKER
    r.scalar(reward=0.5)
    assert r.export() == {"rollout_test/reward": 0.5, "rollout_test/reward__count": 1}


def test_scope_is_per_thread():
    t = DistributedStatsTracker()
    barrier = threading.Barrier(2)

    def worker():
        with t.scope("rollout"):
            barrier.wait()
            t.scalar(a=1.0)
            barrier.wait()

    th = threading.Thread(target=worker)
    th.start()
    with t.scope("train"):
        barrier.wait()
        t.scalar(b=2.0)
        barrier.wait()
    th.join()
    out = t.export()
    assert set(out) == {"rollout/a", "rollout/a__count", "train/b", "train/b__count"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        t = DistributedStatsTracker()
        with t.scope("actor"):
            if rank == 0:
                t.denominator(m=torch.tensor([True, True, False]))
                t.stat(x=torch.tensor([1.0, 2.0, 99.0]), denominator="m")
                t.scalar(only_rank0=4.0)
            else:
                t.denominator(m=torch.tensor([True, False]))
                t.stat(x=torch.tensor([9.0, -99.0]), denominator="m")
                t.scalar(only_rank1=8.0)
        q.put((rank, t.export(reduce_group=dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


def test_export_two_gloo_ranks_reduces_sums_counts_min_max():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    out = results[0]
    assert out["actor/m"] == 3
    assert out["actor/x/avg"] == pytest.approx(4.0)  # (1 + 2 + 9) / 3
    assert out["actor/x/min"] == 1.0 and out["actor/x/max"] == 9.0
    assert out["actor/only_rank0"] == 4.0 and out["actor/only_rank1"] == 8.0
