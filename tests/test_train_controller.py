"""TrainController: token-balanced split, order-preserving merge, real 2-rank gloo workers."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future

import pytest
import torch
from _proc_helpers import leftover_children, now_minus

from areal.api.io_struct import WeightUpdateMeta
from areal.api.scheduler_api import RemoteCallError, WorkerDiedError
from areal.infra.controller import TrainController
from areal.infra.controller.train_controller import (
    balanced_partition,
    merge_rank_results,
    slice_batch,
    split_batch_indices,
)
from areal.infra.scheduler import LocalScheduler

ENGINE = "tests._rpc_engines.DistTestEngine"


def _batch(lens: list[int], T: int = 12) -> dict:
    lens_t = torch.tensor(lens)
    B = len(lens)
    mask = (torch.arange(T)[None] < lens_t[:, None]).long()
    return {
        "input_ids": torch.arange(B * T).reshape(B, T) * mask,
        "attention_mask": mask,
        "rewards": torch.arange(B).float(),
        "meta": "replicated",
    }


# ------------------------------------------------------------------ pure functions
def test_balanced_partition_uneven_weights_near_equal_loads():
    parts = balanced_partition([10, 9, 1, 1, 5, 5, 2, 3], 2)
    loads = [sum([10, 9, 1, 1, 5, 5, 2, 3][i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert abs(loads[0] - loads[1]) <= 1
    assert all(p == sorted(p) for p in parts)


def test_balanced_partition_fewer_units_than_ranks_raises():
    with pytest.raises(ValueError, match="Cannot split 1 units across 2"):
        balanced_partition([5], 2)


def test_split_batch_indices_groups_kept_together():
    batch = _batch([12, 12, 1, 1, 6, 6, 3, 3])
    idx = split_batch_indices(batch, 2, group_size=2)
    for part in idx:
        for g in set((part // 2).tolist()):
            assert {2 * g, 2 * g + 1} <= set(part.tolist())
    with pytest.raises(ValueError, match="group_size=3"):
        split_batch_indices(batch, 2, group_size=3)


def test_split_batch_indices_group_ids_of_fixed_layout_same_split_as_group_size():
    gen = torch.Generator().manual_seed(1)
    for algo in ("ffd", "kk"):
        for _ in range(20):
            batch = _batch(torch.randint(1, 13, (24,), generator=gen).tolist())
            fixed = split_batch_indices(batch, 3, group_size=4, packing_algorithm=algo)
            batch["group_ids"] = torch.arange(6).repeat_interleave(4) + 100
            by_id = split_batch_indices(batch, 3, group_size=1, packing_algorithm=algo)
            assert [p.tolist() for p in by_id] == [p.tolist() for p in fixed]


def test_split_batch_indices_variable_size_groups_by_id_kept_together():
    # agent groups exported one row per call: 3, 7, 2, 4 and 5 rows, one group interleaved
    gids = [7] * 3 + [2] * 7 + [9] * 2 + [4] * 4 + [7, 7] + [5] * 3
    batch = _batch([(3 * i) % 11 + 1 for i in range(len(gids))])
    batch["group_ids"] = torch.tensor(gids)
    with pytest.raises(ValueError, match="not a multiple"):
        split_batch_indices({k: v for k, v in batch.items() if k != "group_ids"}, 2, 4)
    for algo in ("ffd", "kk"):
        idx = split_batch_indices(batch, 2, group_size=4, packing_algorithm=algo)
        rows = [r for part in idx for r in part.tolist()]
        assert sorted(rows) == list(range(len(gids)))
        assert all(part.tolist() == sorted(part.tolist()) for part in idx)
        owner = {}
        for k, part in enumerate(idx):
            for r in part.tolist():
                assert owner.setdefault(gids[r], k) == k  # a group never spans two ranks
        assert len(set(owner.values())) == 2


def _rank_tokens(batch, idx):
    return [int(batch["attention_mask"][i].sum()) for i in idx]


def test_split_batch_indices_kk_more_even_than_greedy_groups_kept():
    # greedy (ffd): 8+5+4 | 7+6 = 17 | 13 tokens; Karmarkar-Karp: 16 | 14
    batch = _batch([8, 7, 6, 5, 4])
    ffd = [sum(_rank_tokens(batch, i)) for i in split_batch_indices(batch, 2)]
    kk = [sum(_rank_tokens(batch, i)) for i in split_batch_indices(batch, 2, 1, "kk")]
    assert sorted(ffd) == [13, 17] and sorted(kk) == [14, 16]
    # random GRPO batches: whole groups on one rank, every row once, never less even
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        lens = torch.randint(1, 13, (24,), generator=gen).tolist()
        batch = _batch(lens)
        spreads = {}
        for algo in ("ffd", "kk"):
            idx = split_batch_indices(batch, 3, group_size=4, packing_algorithm=algo)
            rows = sorted(i for part in idx for i in part.tolist())
            assert rows == list(range(24))
            for part in idx:
                groups = set((part // 4).tolist())
                assert sorted(part.tolist()) == [
                    4 * g + j for g in sorted(groups) for j in range(4)
                ]
            loads = [sum(_rank_tokens(batch, part)) for part in idx]
            spreads[algo] = max(loads) - min(loads)
        assert spreads["kk"] <= spreads["ffd"]
    with pytest.raises(ValueError, match="packing_algorithm='lpt'"):
        split_batch_indices(batch, 2, packing_algorithm="lpt")


def test_controller_dispatch_uses_config_packing_algorithm():
    from areal.api.cli_args import MicroBatchSpec, TrainEngineConfig

    class Capture(TrainController):
        def _call_all(self, method, per_rank, **kw):
            return [args[0]["attention_mask"].sum().item() for args, _ in per_rank]

    batch = _batch([8, 7, 6, 5, 4])
    loads = {}
    for algo in ("ffd", "kk"):
        cfg = TrainEngineConfig(mb_spec=MicroBatchSpec(packing_algorithm=algo))
        ctl = Capture(ENGINE, cfg, scheduler=None)
        ctl.workers, ctl.dp_size = ["w0", "w1"], 2
        ctl.dp_ranks, ctl.workers_is_dp_head = [0, 1], [True, True]
        loads[algo] = sorted(ctl.custom_function_call("forward_batch", batch, _merge=False))
    assert loads == {"ffd": [13, 17], "kk": [14, 16]}


def test_merge_rank_results_tensors_and_dicts_original_order():
    batch = _batch([5, 9, 2, 7, 1])
    idx = split_batch_indices(batch, 2)
    parts = [slice_batch(batch, i) for i in idx]
    assert all(p["meta"] == "replicated" for p in parts)
    merged = merge_rank_results([p["input_ids"] for p in parts], idx)
    assert torch.equal(merged, batch["input_ids"])
    merged_d = merge_rank_results(
        [{"x": p["rewards"], "loss": 1.0 * k} for k, p in enumerate(parts)], idx
    )
    assert torch.equal(merged_d["x"], batch["rewards"]) and merged_d["loss"] == 0.0
    assert merge_rank_results([{"loss": 3.0}, {"loss": 4.0}], idx) == {"loss": 3.0}
    # different T per rank: right-padded with zeros to the longest
    short = [p["input_ids"][:, : 4 + k] for k, p in enumerate(parts)]
    merged_s = merge_rank_results(short, idx)
    assert merged_s.shape == (5, 5)


# ------------------------------------------------------------------ real workers
_FIXTURE_PIDS: set[int] = set()  # workers of the module fixture, alive during other tests


_TEST_START = [0.0]


@pytest.fixture(autouse=True)
def _record_test_start():
    """Children that existed before the test (other modules' fixtures, e.g. Slurm daemons) are not its leftovers."""
    _TEST_START[0] = now_minus(0.5)
    yield


def _assert_no_children():
    kids = leftover_children(since=_TEST_START[0], exclude_pids=_FIXTURE_PIDS)
    assert not kids, [(c.pid, c.cmdline()) for c in kids]


@pytest.fixture(scope="module")
def ctrl(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctrl")
    sched = LocalScheduler(fileroot=str(root), startup_timeout=120, call_timeout=120)
    try:
        c = TrainController(ENGINE, {"lr": 1.0}, sched, group_size=1)
        # wait=False (as the trainer starts its roles): returns once the processes are
        # started, before they serve (each imports torch first); the engine thread waits
        c.initialize("actor", world_size=2, ft_spec=None, extra_flag=True, wait=False)
        assert c.workers == [] and len(sched.worker_pids("actor")) == 2
        c.wait_ready()
        assert [w.id for w in c.workers] == ["actor/0", "actor/1"]
        _FIXTURE_PIDS.update(sched.worker_pids())
        yield c
        c.destroy()
    finally:
        sched.close()
        _FIXTURE_PIDS.clear()
    _assert_no_children()


def test_forward_batch_two_ranks_merged_in_original_order(ctrl):
    batch = _batch([12, 1, 7, 3, 9, 2, 5, 11])
    out = ctrl.forward_batch(batch)
    assert torch.equal(out, batch["input_ids"].float() * 2 * batch["attention_mask"])


def test_custom_call_split_balanced_by_tokens(ctrl):
    lens = [12, 1, 7, 3, 9, 2, 5, 11]
    batch = _batch(lens)
    ranks = ctrl.custom_function_call("rank_of_each_sequence", batch)
    assert ranks.shape == (8,) and set(ranks.tolist()) == {0, 1}
    loads = [sum(n for n, r in zip(lens, ranks.tolist()) if r == k) for k in (0, 1)]
    assert abs(loads[0] - loads[1]) <= 1, loads
    per_rank = ctrl.custom_function_call("train_batch", batch, None, None, _merge=False)
    assert [s["rank"] for s in per_rank] == [0, 1]
    assert {s["total_tokens"] for s in per_rank} == {float(sum(lens))}  # gloo all_reduce ran
    assert sorted(s["local_tokens"] for s in per_rank) == sorted(float(x) for x in loads)


def test_custom_call_group_size_keeps_groups_on_one_rank(ctrl):
    batch = _batch([12, 11, 1, 2, 6, 6, 3, 4])
    ranks = ctrl.custom_function_call("rank_of_each_sequence", batch, _group_size=2)
    assert all(ranks[2 * g] == ranks[2 * g + 1] for g in range(4))
    stats = ctrl.train_batch(batch, None, None)
    assert stats["rank"] == 0 and stats["total_tokens"] == 45.0


def test_compute_advantages_all_ranks_batch_norm_original_order(ctrl):
    batch = _batch([3, 9, 5, 6, 2, 8])
    out = ctrl.compute_advantages(batch, _group_size=2)
    assert out["adv_rank"] == 0
    assert torch.equal(out["input_ids"], batch["input_ids"]) and out["meta"] == "replicated"
    expected = (batch["rewards"] - batch["rewards"].mean()).unsqueeze(1) * batch["attention_mask"]
    torch.testing.assert_close(out["advantages"], expected)


def test_broadcast_methods_set_get_version_and_collective(ctrl):
    ctrl.set_version(7)
    assert ctrl.get_version() == 7
    assert ctrl.custom_function_call("get_version", _merge=False) == [7, 7]
    assert ctrl.custom_function_call("world") == 2
    assert ctrl.custom_function_call("config", _merge=False) == [{"lr": 1.0}] * 2
    assert ctrl.custom_function_call("init_kwargs") == {"extra_flag": True}


def test_custom_call_remote_exception_names_worker_and_method(ctrl):
    with pytest.raises(RemoteCallError, match=r"actor/\d: no_such_method raised AttributeError"):
        ctrl.custom_function_call("no_such_method")
    # a misspelt method is an error here, not a call to the workers
    with pytest.raises(AttributeError):
        ctrl.no_such_method()


def test_every_public_host_method_is_an_explicit_controller_method():
    """The algorithm hosts' public methods (FSDP and Archon) are all reachable on the
    controller by name: written out there or listed in ENGINE_CALLS (no __getattr__)."""
    import inspect

    from areal.infra.controller.engine_calls import ENGINE_CALLS
    from areal.trainer import archon_hosts
    from areal.trainer.dpo.dpo_engine import FSDPDPOEngine
    from areal.trainer.ppo.actor import FSDPPPOActor
    from areal.trainer.ppo.critic import FSDPPPOCritic
    from areal.trainer.rw.rw_engine import FSDPRWEngine
    from areal.trainer.sft.lm_engine import FSDPLMEngine

    assert "__getattr__" not in vars(TrainController)
    hosts = [FSDPPPOActor, FSDPPPOCritic, FSDPLMEngine, FSDPRWEngine, FSDPDPOEngine]
    hosts += [getattr(archon_hosts, n) for n in archon_hosts.__all__]
    public = {
        name
        for cls in hosts
        for name, value in inspect.getmembers(cls, callable)
        if not name.startswith("_") and not isinstance(value, type)
    }
    missing = sorted(n for n in public if not hasattr(TrainController, n))
    assert missing == [], missing
    # ENGINE_CALLS holds engine methods only (no stale names)
    assert set(ENGINE_CALLS) <= public, sorted(set(ENGINE_CALLS) - public)


class _FakeInferenceEngine:
    def __init__(self):
        self.calls = []

    def update_weights_from_disk(self, meta):
        self.calls.append(("disk", meta.path, open(os.path.join(meta.path, "model.txt")).read()))
        fut = Future()
        fut.set_result(None)
        return fut


def test_update_weights_disk_saves_then_reloads_inference(ctrl, tmp_path):
    engine = _FakeInferenceEngine()
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "wu")).with_version(3)
    with pytest.raises(RuntimeError, match="connect_engine"):
        TrainController(ENGINE, None, ctrl.scheduler).update_weights(meta)
    ctrl.set_version(3)
    ctrl.connect_engine(engine, meta)
    ctrl.update_weights(meta)
    assert engine.calls == [("disk", meta.path, "version=3")]


def test_custom_call_rank_killed_raises_worker_died_fast(tmp_path):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=120, call_timeout=120) as sched:
        c = TrainController(ENGINE, None, sched)
        c.initialize("victim", world_size=2)
        pid = sched.worker_pids("victim")[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"victim/1 .*exit code -9"):
            c.custom_function_call(
                "world"
            )  # rank 0 would wait in all_reduce; the dead rank is reported at once
        c.destroy()
    _assert_no_children()


# ------------------------------------------------------------------ FSDPEngine workers
@pytest.mark.slow
def test_fsdp_two_workers_match_single_rank_worker(tmp_path, tiny_model_dir, monkeypatch):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec

    # Workers import the loss functions by module name ``_rpc_engines``.
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    )
    from _rpc_engines import sft_loss_fn, sft_loss_weight_fn

    config = TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=tiny_model_dir,
        dtype="float32",
        optimizer=OptimizerConfig(
            lr=1e-3, weight_decay=0.0, warmup_steps_proportion=0.0, gradient_clipping=1.0
        ),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=None),
        num_threads=1,
    )
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([40, 9, 30, 17, 33, 5, 23, 36])
    T = 40
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    batch = {
        "input_ids": torch.randint(3, 400, (8, T), generator=g) * mask,
        "attention_mask": mask,
        "loss_mask": ((torch.arange(T)[None] >= 3) & mask.bool()).long(),
    }
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1)
    results = {}
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=180, call_timeout=300) as sched:
        for role, ws in (("single", 1), ("pair", 2)):
            c = TrainController("areal.engine.fsdp_engine.FSDPEngine", config, sched)
            c.initialize(role, world_size=ws, ft_spec=ft_spec)
            before = c.forward_batch(batch)
            stats = c.train_batch(batch, sft_loss_fn, sft_loss_weight_fn)
            after = c.forward_batch(batch)
            results[role] = (before, stats, after)
            c.destroy()
    (b1, s1, a1), (b2, s2, a2) = results["single"], results["pair"]
    assert b1.shape == (8, T) and not torch.equal(a1, b1)
    torch.testing.assert_close(b2, b1, atol=1e-5, rtol=0)
    # after one Adam step fp32 reduction-order noise grows to ~1e-5 on |logp| ~ 6
    torch.testing.assert_close(a2, a1, atol=1e-5, rtol=1e-5)
    assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], abs=1e-5)
    _assert_no_children()
