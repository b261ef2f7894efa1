"""WorkflowExecutor against an in-process fake engine, and against the built-in server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal.api.workflow_api import RolloutWorkflow
from areal.infra.workflow_executor import WorkflowExecutor


# --------------------------------------------------------------------------- fakes
class FakeEngine:
    """Only what the executor needs: a thread-safe weight version."""

    def __init__(self):
        self._v = 0
        self._lock = threading.Lock()

    def get_version(self) -> int:
        with self._lock:
            return self._v

    def set_version(self, v: int) -> None:
        with self._lock:
            self._v = v


def make_config(**kw):
    from areal.api.cli_args import InferenceEngineConfig

    return InferenceEngineConfig(**kw)


def traj(version: int, prompt_len: int, gen_len: int, reward: float = 1.0, uid: int = 0):
    T = prompt_len + gen_len
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, prompt_len:] = 1
    versions = torch.full((1, T), -1, dtype=torch.long)
    versions[0, prompt_len:] = version
    return dict(
        input_ids=torch.randint(1, 100, (1, T)),
        attention_mask=torch.ones(1, T, dtype=torch.long),
        loss_mask=loss_mask,
        logprobs=torch.where(loss_mask.bool(), -0.5, 0.0).float(),
        versions=versions,
        rewards=torch.tensor([reward], dtype=torch.float32),
        uid=torch.tensor([uid]),
    )


class SleepWorkflow(RolloutWorkflow):
    """Sleeps a data-given latency; records the version at start, the concurrency, and how
    many sleeps ran to their end (``slept``) or were cancelled (``cancelled``)."""

    def __init__(self, fail_every: int = 0, reward_fn=None):
        self.fail_every = fail_every
        self.reward_fn = reward_fn
        self.in_flight = 0
        self.max_in_flight = 0
        self.started = 0
        self.slept = 0
        self.cancelled = 0

    async def arun_episode(self, engine, data):
        self.in_flight += 1
        self.started += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            v = engine.get_version()
            try:
                await asyncio.sleep(data.get("latency", 0.001))
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            self.slept += 1
            uid = data.get("uid", 0)
            if self.fail_every and uid % self.fail_every == 0:
                raise RuntimeError(f"boom on {uid}")
            if data.get("reject"):
                return None
            reward = self.reward_fn(data) if self.reward_fn else 1.0
            return traj(v, 2 + uid % 3, 1 + uid % 4, reward=reward, uid=uid)
        finally:
            self.in_flight -= 1


@pytest.fixture
def engine():
    return FakeEngine()


def start_executor(engine, **cfg):
    ex = WorkflowExecutor(make_config(**cfg), engine)
    ex.initialize()
    return ex


def list_loader(n: int, batch: int, latency=0.001, **extra):
    items = [dict(uid=i, latency=latency, **extra) for i in range(n)]
    return [items[i : i + batch] for i in range(0, n, batch)]


# --------------------------------------------------------------------------- basics
def test_submit_before_initialize_raises_runtime_error(engine):
    ex = WorkflowExecutor(make_config(), engine)
    with pytest.raises(RuntimeError, match="initialize"):
        ex.submit({"uid": 0}, SleepWorkflow())


def test_rollout_batch_returns_padded_batch_with_prompt_versions_minus_one(engine):
    ex = start_executor(engine, consumer_batch_size=4, max_concurrent_rollouts=4)
    try:
        data = [dict(uid=i, latency=0.001 * i) for i in range(4)]
        batch = ex.rollout_batch(data, SleepWorkflow(), timeout=10)
    finally:
        ex.destroy()
    assert batch["input_ids"].shape[0] == 4
    T = batch["input_ids"].shape[1]
    assert T == max(2 + i % 3 + 1 + i % 4 for i in range(4))
    am = batch["attention_mask"].bool()
    # padding: versions -1, loss_mask 0
    assert (batch["versions"][~am] == -1).all()
    assert (batch["loss_mask"][~am] == 0).all()
    assert (batch["versions"][batch["loss_mask"].bool()] == 0).all()
    assert sorted(batch["uid"].tolist()) == [0, 1, 2, 3]


def test_workflow_given_as_class_or_import_string_is_instantiated_once(engine):
    ex = start_executor(
        engine, consumer_batch_size=2, max_concurrent_rollouts=2, max_head_offpolicyness=10
    )
    try:
        kwargs = {"fail_every": 0}
        b1 = ex.rollout_batch([dict(uid=1), dict(uid=2)], SleepWorkflow, kwargs, timeout=10)
        path = f"{__name__}.SleepWorkflow"
        b2 = ex.rollout_batch([dict(uid=1), dict(uid=2)], path, {"fail_every": 0}, timeout=10)
        ex.rollout_batch([dict(uid=3)], path, {"fail_every": 0}, timeout=10)
        assert len(ex._workflow_cache) == 2  # one per (class, kwargs) / (string, kwargs)
    finally:
        ex.destroy()
    assert b1["input_ids"].shape[0] == 2 and b2["input_ids"].shape[0] == 2


def test_workflow_kwargs_with_instance_raise_value_error(engine):
    ex = start_executor(engine)
    try:
        with pytest.raises(ValueError, match="workflow_kwargs"):
            ex.submit({"uid": 0}, SleepWorkflow(), {"fail_every": 1})
        with pytest.raises(ValueError, match="workflow is required"):
            ex.submit({"uid": 0}, None)
    finally:
        ex.destroy()


def test_wait_timeout_raises_with_arrived_running_queued_counts(engine):
    ex = start_executor(engine, consumer_batch_size=1, max_concurrent_rollouts=1)
    try:
        wf = SleepWorkflow()
        ex.submit(dict(uid=1, latency=5.0), wf)
        ex.submit(dict(uid=2, latency=5.0), wf)
        with pytest.raises(TimeoutError) as ei:
            ex.wait(2, timeout=0.3)
        # raised before the 5 s rollout ended: nothing had arrived
        msg = str(ei.value)
        assert "0 arrived" in msg and "1 running" in msg and "1 queued" in msg
        assert ex.wait(1, timeout=0.05, raise_timeout=False) is None
    finally:
        ex.destroy()
    # the running 5 s rollout was cancelled, not awaited; the queued one never started
    assert (wf.slept, wf.cancelled, wf.started) == (0, 1, 1)


def test_failing_and_none_workflows_counted_rejected_and_replaced(engine):
    ex = start_executor(
        engine, consumer_batch_size=4, max_concurrent_rollouts=8, max_head_offpolicyness=1
    )
    wf = SleepWorkflow(fail_every=10)
    loader = list_loader(40, 4)
    loader[1][1]["reject"] = True  # uid 5 returns None
    try:
        seen = []
        for step in range(8):
            batch = ex.prepare_batch(loader, wf, timeout=20)
            assert batch["input_ids"].shape[0] == 4
            seen.extend(batch["uid"].tolist())
            engine.set_version(step + 1)
    finally:
        ex.destroy()
    assert all(u % 10 != 0 for u in seen)
    assert 5 not in seen
    reasons = ex.rejection_reasons
    assert reasons.get("error", 0) >= 3  # uids 0, 10, 20 at least
    assert reasons.get("none", 0) == 1
    assert ex.get_stats().rejected >= 4


def dapo_filter(trajectory) -> bool:
    r = trajectory["rewards"]
    return bool((r != r[0]).any())


def test_should_accept_fn_import_string_drops_all_equal_groups(engine):
    rng = random.Random(0)
    ex = start_executor(
        engine, consumer_batch_size=3, max_concurrent_rollouts=6, max_head_offpolicyness=0
    )
    wf = SleepWorkflow(reward_fn=lambda d: float(rng.random() < 0.5))
    loader = list_loader(30, 3)
    try:
        for step in range(4):
            batch = ex.prepare_batch(
                loader, wf, should_accept_fn=f"{__name__}.dapo_filter", group_size=4, timeout=20
            )
            assert batch["rewards"].shape[0] == 12  # 3 groups x 4 samples
            for g in batch["rewards"].view(3, 4):
                assert not torch.all(g == g[0])
            engine.set_version(step + 1)
    finally:
        ex.destroy()
    # p(all equal) = 1/8 per group: some were filtered
    assert ex.rejection_reasons.get("filtered", 0) >= 1
    # versions: with eta=0 every consumed token was generated at the consumption version
    assert ex.last_submit_versions == [3, 3, 3]


def test_pause_stops_new_rollouts_and_resume_restarts(engine):
    ex = start_executor(engine, consumer_batch_size=2, max_concurrent_rollouts=2)
    wf = SleepWorkflow()
    try:
        ex.pause()
        assert ex.is_paused
        ex.submit(dict(uid=1), wf)
        time.sleep(0.2)
        assert wf.started == 0 and ex.get_stats().enqueued == 1
        with pytest.raises(TimeoutError):
            ex.wait(1, timeout=0.1)
        ex.resume()
        out = ex.wait(1, timeout=5)
        assert out["uid"].tolist() == [1]
    finally:
        ex.destroy()


def test_max_concurrent_rollouts_is_never_exceeded(engine):
    ex = start_executor(
        engine, consumer_batch_size=16, max_concurrent_rollouts=3, max_head_offpolicyness=4
    )
    wf = SleepWorkflow()
    try:
        ex.rollout_batch([dict(uid=i, latency=0.01) for i in range(16)], wf, timeout=20)
    finally:
        ex.destroy()
    assert wf.max_in_flight == 3


def test_stale_result_dropped_when_version_moves_past_bound(engine):
    ex = start_executor(
        engine, consumer_batch_size=1, max_concurrent_rollouts=2, max_head_offpolicyness=0
    )
    wf = SleepWorkflow()
    try:
        ex.submit(dict(uid=1, latency=0.3), wf)
        time.sleep(0.1)
        engine.set_version(1)  # the running rollout is now one version behind
        with pytest.raises(TimeoutError):
            ex.wait(1, timeout=0.6)
        assert ex.rejection_reasons == {"stale": 1}
        # its row is not lost: it waits to be generated again (and a checkpoint keeps it)
        assert ex.pending_data() == [dict(uid=1, latency=0.3)]
        # a fresh one at version 1 is fine
        ex.submit(dict(uid=2), wf)
        assert ex.wait(1, timeout=5)["uid"].tolist() == [2]
    finally:
        ex.destroy()


def test_prepare_batch_row_of_stale_rollout_is_trained_later_not_lost(engine):
    ex = start_executor(
        engine, consumer_batch_size=1, max_concurrent_rollouts=2, max_head_offpolicyness=0
    )

    class SlowOnce(SleepWorkflow):
        """The first attempt of each row takes 0.3 s more (e.g. retries after a drop)."""

        def __init__(self):
            super().__init__()
            self.seen = set()

        async def arun_episode(self, engine, data):
            if data["uid"] not in self.seen:
                self.seen.add(data["uid"])
                if data["uid"] == 7:
                    await asyncio.sleep(0.3)
            return await super().arun_episode(engine, data)

    wf = SlowOnce()
    try:
        ex.submit(dict(uid=7), wf)
        time.sleep(0.1)
        engine.set_version(1)  # uid 7 finishes stale
        deadline = time.monotonic() + 5
        while not ex.rejection_reasons and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.rejection_reasons == {"stale": 1}
        loader = list_loader(3, 1)
        uids = []
        for step in range(4):
            uids += ex.prepare_batch(loader, wf, timeout=10)["uid"].tolist()
            engine.set_version(2 + step)  # a trainer step (older results go stale too)
        assert sorted(uids) == [0, 1, 2, 7]
    finally:
        ex.destroy()


def test_prepare_batch_row_of_rollout_without_servers_is_requeued_not_lost(engine):
    from areal.infra.remote_inf_engine import NoHealthyServerError

    ex = start_executor(engine, consumer_batch_size=1, max_concurrent_rollouts=2)

    class NoServerOnce(SleepWorkflow):
        """uid 5's first attempt finds every server out of rotation for a moment."""

        def __init__(self):
            super().__init__()
            self.failed = False

        async def arun_episode(self, engine, data):
            if data["uid"] == 5 and not self.failed:
                self.failed = True
                raise NoHealthyServerError("no healthy inference server left")
            return await super().arun_episode(engine, data)

    wf = NoServerOnce()
    try:
        loader = list_loader(3, 1)
        ex.submit(dict(uid=5), wf)
        uids = []
        for step in range(4):
            uids += ex.prepare_batch(loader, wf, timeout=10)["uid"].tolist()
            engine.set_version(1 + step)  # a trainer step
        # counted (not as a workflow error) and the row trained later: nothing lost
        assert ex.rejection_reasons == {"no_server": 1}
        assert sorted(uids) == [0, 1, 2, 5]
    finally:
        ex.destroy()


def test_queued_result_dropped_at_consumption_when_too_old(engine):
    ex = start_executor(
        engine, consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=1
    )
    wf = SleepWorkflow()
    try:
        ex.submit(dict(uid=1), wf)
        ex.submit(dict(uid=2), wf)
        deadline = time.monotonic() + 5
        while len(ex._results) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.set_version(2)
        out = ex.wait(1, timeout=0.3, raise_timeout=False)
        assert out is None
        assert ex.rejection_reasons == {"stale": 2}
        assert ex.get_stats().accepted == 0  # slots freed
        assert [d["uid"] for d in ex.pending_data()] == [1, 2]  # re-queued, not lost
    finally:
        ex.destroy()


def test_trajectory_format_check_rejects_malformed_output(engine):
    class Bad(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            return {"input_ids": torch.ones(3)}  # 1-D, no attention_mask

    ex = start_executor(engine, check_trajectory_format=True)
    try:
        ex.submit({}, Bad())
        with pytest.raises(TimeoutError):
            ex.wait(1, timeout=0.3)
        assert ex.rejection_reasons == {"invalid": 1}
    finally:
        ex.destroy()


def test_non_tensor_results_returned_as_list(engine):
    class Plain(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            return {"text": data["x"]}

    ex = start_executor(engine, consumer_batch_size=2, max_concurrent_rollouts=2)
    try:
        out = ex.rollout_batch([{"x": "a"}, {"x": "b"}], Plain(), timeout=5)
    finally:
        ex.destroy()
    assert sorted(o["text"] for o in out) == ["a", "b"]


def test_eval_tasks_bypass_staleness_accounting(engine):
    ex = start_executor(
        engine, consumer_batch_size=1, max_concurrent_rollouts=4, max_head_offpolicyness=0
    )
    wf = SleepWorkflow()
    try:
        for i in range(3):  # more than the staleness bound allows for training
            ex.submit(dict(uid=i), wf, is_eval=True)
        out = ex.wait(3, timeout=5)
        assert out["input_ids"].shape[0] == 3
        assert ex.get_stats().accepted == 0
    finally:
        ex.destroy()


def test_version_recovered_limits_burst_after_resume(engine):
    engine.set_version(5)
    ex = start_executor(
        engine, consumer_batch_size=2, max_concurrent_rollouts=100, max_head_offpolicyness=1
    )
    try:
        ex.on_version_recovered(5)
        assert ex.get_capacity() == 4
    finally:
        ex.destroy()


def test_prepare_batch_keeps_rollouts_running_while_trainer_trains(engine):
    ex = start_executor(
        engine, consumer_batch_size=4, max_concurrent_rollouts=8, max_head_offpolicyness=1
    )
    wf = SleepWorkflow()
    loader = list_loader(64, 4, latency=0.05)
    try:
        ex.prepare_batch(loader, wf, timeout=20)
        # the next batch was already started in the background, up to the bound
        s = ex.get_stats()
        assert s.accepted + s.running == (1 + 0 + 1) * 4
        assert s.enqueued >= 4  # work queued for the capacity the next version opens
        started = wf.started
        engine.set_version(1)  # weight update done; trainer busy elsewhere
        time.sleep(0.3)  # no executor calls
        assert wf.started >= started + 4
        s = ex.get_stats()
        assert s.accepted + s.running == (1 + 1 + 1) * 4
    finally:
        ex.destroy()


def test_dataloader_is_cycled_across_epochs(engine):
    ex = start_executor(engine, consumer_batch_size=3, max_concurrent_rollouts=3)
    wf = SleepWorkflow()
    loader = list_loader(4, 2)  # 4 items per epoch
    try:
        uids = []
        for step in range(4):
            uids.extend(ex.prepare_batch(loader, wf, timeout=10)["uid"].tolist())
            engine.set_version(step + 1)
    finally:
        ex.destroy()
    assert len(uids) == 12 and set(uids) == {0, 1, 2, 3}


# --------------------------------------------------------------------------- property test
def _trainer_run(eta, bs, conc, n_steps, seed, fail_rate):
    rng = random.Random(seed)
    engine = FakeEngine()
    ex = start_executor(
        engine, consumer_batch_size=bs, max_concurrent_rollouts=conc, max_head_offpolicyness=eta
    )
    n_items = 7 * bs + 3
    items = [
        dict(
            uid=i,
            latency=rng.choice([0.0, 0.001, 0.003, 0.01, 0.03]),
            reject=rng.random() < fail_rate,
        )
        for i in range(n_items)
    ]
    loader = [items[i : i + 3] for i in range(0, n_items, 3)]
    wf = SleepWorkflow()
    caps = []
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            caps.append(ex.get_capacity())
            time.sleep(0.002)

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    try:
        for _step in range(n_steps):
            batch = ex.prepare_batch(loader, wf, timeout=30)
            v = engine.get_version()
            assert batch["input_ids"].shape[0] == bs
            # executor-recorded submit versions
            assert len(ex.last_submit_versions) == bs
            assert all(v - sv <= eta for sv in ex.last_submit_versions)
            # per-token versions of generated tokens (stamped at episode start)
            gen = batch["versions"][batch["loss_mask"].bool()]
            assert (gen <= v).all() and (v - gen <= eta).all()
            if eta == 0:
                assert all(sv == v for sv in ex.last_submit_versions)
                assert (gen == v).all()
            time.sleep(rng.choice([0.0, 0.002, 0.01]))  # "training"
            engine.set_version(v + 1)
    finally:
        stop.set()
        mon.join()
        ex.destroy()
    assert min(caps) >= 0
    assert wf.max_in_flight <= conc


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    eta=st.integers(0, 3),
    bs=st.integers(1, 4),
    conc=st.integers(1, 8),
    n_steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    fail_rate=st.sampled_from([0.0, 0.2]),
)
def test_property_consumed_samples_never_older_than_eta(eta, bs, conc, n_steps, seed, fail_rate):
    _trainer_run(eta, bs, conc, n_steps, seed, fail_rate)


def test_synchronous_eta0_every_sample_submitted_at_current_version():
    for seed in range(3):
        _trainer_run(eta=0, bs=3, conc=8, n_steps=4, seed=seed, fail_rate=0.0)


# --------------------------------------------------------------------------- AReaL semantics
class Interaction:
    """What an agent client returns per completion: an object with ``to_tensor_dict()``."""

    def __init__(self, uid: int, reward: float):
        self.uid, self.reward = uid, reward

    def to_tensor_dict(self):
        return traj(0, 2, 1 + self.uid, reward=self.reward, uid=self.uid)


class InteractionWorkflow(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        await asyncio.sleep(0.001)
        return {f"c{k}": Interaction(k, float(k)) for k in range(data["turns"])}


def test_dict_of_interactions_concatenated_into_one_batch(engine):
    ex = start_executor(engine, consumer_batch_size=2, max_concurrent_rollouts=4)
    try:
        batch = ex.rollout_batch([dict(turns=2), dict(turns=3)], InteractionWorkflow(), timeout=10)
    finally:
        ex.destroy()
    assert batch["input_ids"].shape[0] == 5
    assert batch["rewards"].tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    # padded to the longest interaction (prompt 2 + 3 generated tokens)
    assert batch["input_ids"].shape[1] == 5


def test_grouped_interaction_dicts_merged_then_concatenated(engine):
    ex = start_executor(engine, consumer_batch_size=1, max_concurrent_rollouts=2)

    class UniqueKeys(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            from areal.infra import workflow_context

            i = workflow_context.get().sample_index
            return {f"g{i}": Interaction(i, float(i))}

    try:
        batch = ex.rollout_batch([dict()], UniqueKeys(), group_size=3, timeout=10)
    finally:
        ex.destroy()
    assert sorted(batch["rewards"].tolist()) == [0.0, 1.0, 2.0]


class VariableCallsAgentWorkflow(RolloutWorkflow):
    """An agent episode exported one row per call: member ``i`` makes ``1 + i % 3`` calls;
    every call of an episode carries the episode's reward (``data["rewards"][i]``)."""

    async def arun_episode(self, engine, data):
        from areal.infra import workflow_context

        i = workflow_context.get().sample_index
        await asyncio.sleep(0.001 * (3 - i % 3))  # members finish out of order
        reward = data["rewards"][i]
        return {f"t{data['uid']}-e{i}-c{c}": Interaction(c, reward) for c in range(1 + i % 3)}


def test_grouped_variable_calls_rows_carry_group_and_episode_ids_filter_by_episode(engine):
    ex = start_executor(engine, consumer_batch_size=3, max_concurrent_rollouts=8)
    rows = [
        dict(uid=0, rewards=[1.0, 0.0, 1.0, 0.0]),
        dict(uid=1, rewards=[0.5] * 4),  # uniform: dropped by the filter
        dict(uid=2, rewards=[0.0, 0.0, 1.0, 0.0]),
        dict(uid=3, rewards=[1.0, 0.0, 0.0, 0.0]),
    ]
    try:
        batch = ex.rollout_batch(
            rows,
            VariableCallsAgentWorkflow(),
            should_accept_fn="areal.utils.functional.dynamic_sampling_accept",
            group_size=4,
            timeout=10,
        )
    finally:
        ex.destroy()
    assert ex.rejection_reasons == {"filtered": 1}
    # 3 groups x (1 + 2 + 3 + 1) calls: not a multiple of the group size 4
    n = batch["input_ids"].shape[0]
    assert n == 21 and batch["group_ids"].shape == batch["episode_ids"].shape == (n,)
    gids, eids = batch["group_ids"].tolist(), batch["episode_ids"].tolist()
    assert len(set(gids)) == 3 and len(set(eids)) == 12  # unique across groups
    for g in set(gids):
        members = [e for gg, e in zip(gids, eids) if gg == g]
        sizes = sorted(members.count(e) for e in set(members))
        assert sizes == [1, 1, 2, 3]
    for e in set(eids):  # an episode's rows: one group, one reward
        assert len({(gids[k], float(batch["rewards"][k])) for k in range(n) if eids[k] == e}) == 1


def test_rollout_batch_returns_accepted_subset_without_waiting_for_rejected(engine):
    ex = start_executor(engine, consumer_batch_size=4, max_concurrent_rollouts=4)
    data = [dict(uid=i, reject=(i % 2 == 1)) for i in range(4)]
    try:
        batch = ex.rollout_batch(data, SleepWorkflow(), timeout=10)
        assert sorted(batch["uid"].tolist()) == [0, 2]
        assert ex.rollout_batch([dict(uid=5, reject=True)], SleepWorkflow(), timeout=10) == {}
    finally:
        ex.destroy()


def test_dynamic_bs_returns_fewer_groups_when_filter_rejects(engine):
    """dynamic_bs: stop at accepted + rejected == batch size instead of replacing."""
    ex = start_executor(
        engine, consumer_batch_size=4, max_concurrent_rollouts=4, max_head_offpolicyness=0
    )
    # uid 1 and 3 of every 4 give all-equal groups -> filtered
    wf = SleepWorkflow(reward_fn=lambda d: 1.0 if d["uid"] % 2 else float(d["_k"]))
    # the first 4 attempts finish long before the next ones
    items = [dict(uid=i, latency=0.001 if i < 4 else 2.0) for i in range(8)]

    class Indexed(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            from areal.infra import workflow_context

            d = dict(data, _k=workflow_context.get().sample_index)
            return await wf.arun_episode(engine, d)

    try:
        batch = ex.prepare_batch(
            [items[:4], items[4:]],
            Indexed(),
            should_accept_fn=f"{__name__}.dapo_filter",
            group_size=2,
            timeout=20,
            dynamic_bs=True,
        )
    finally:
        ex.destroy()
    # 4 attempts: 2 accepted groups of 2 rows, 2 rejected (not replaced)
    assert batch["rewards"].shape[0] == 4
    assert sorted(set(batch["uid"].tolist())) == [0, 2]


def test_executor_sets_workflow_context_per_task(engine):
    seen = []

    class Ctx(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            from areal.infra import workflow_context

            ctx = workflow_context.get()
            seen.append((ctx.task_id, ctx.is_eval, workflow_context.stat_scope()))
            return traj(0, 2, 1)

    ex = start_executor(engine, consumer_batch_size=2, max_concurrent_rollouts=2)
    try:
        ex.submit(dict(), Ctx(), task_id=7)
        ex.submit(dict(), Ctx(), task_id=8, is_eval=True)
        ex.wait(2, timeout=10)
    finally:
        ex.destroy()
    assert sorted(seen) == [(7, False, "rollout"), (8, True, "eval-rollout")]


def test_dump_to_file_writes_text_rows_under_versioned_dir(engine, tmp_path):
    tok_dir = os.path.join(
        os.path.dirname(__file__), "..", "areal", "models", "assets", "tiny-base"
    )
    ex = start_executor(
        engine,
        consumer_batch_size=2,
        max_concurrent_rollouts=2,
        dump_to_file=True,
        fileroot=str(tmp_path),
        experiment_name="exp",
        trial_name="t0",
        tokenizer_path=tok_dir,
    )
    engine.set_version(3)
    try:
        ex.rollout_batch([dict(uid=1), dict(uid=2)], SleepWorkflow(), timeout=30)
    finally:
        ex.destroy()
    files = sorted((tmp_path / "logs" / "exp" / "t0" / "rollout" / "3").glob("*.jsonl"))
    assert len(files) == 2
    rec = json.loads(files[0].read_text().splitlines()[0])
    assert rec["reward"] == 1.0 and rec["prompt_len"] + len(rec["completion"]) > 0
    assert rec["seqlen"] > rec["prompt_len"]


def test_discard_all_drops_every_rollout_and_restarts_with_fresh_counters(engine):
    """Run health's rollback: nothing generated by the undone weights is trained on."""
    ex = start_executor(
        engine, consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=4
    )
    wf = SleepWorkflow()
    try:
        for uid in range(2):  # finished, not consumed
            ex.submit(dict(uid=uid), wf)
        deadline = time.monotonic() + 5
        while len(ex._results) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        for uid in range(10, 14):  # running (sleep 30 s) or queued
            ex.submit(dict(uid=uid, latency=30.0), wf)
        ex.requeue_data([dict(uid=99)])
        time.sleep(0.1)
        assert wf.in_flight > 0 and wf.slept == 2
        assert ex.discard_all() == 7
        # the running ones were cancelled, not awaited (none of the 30 s sleeps ended)
        assert wf.slept == 2 and wf.cancelled == wf.started - 2 > 0
        assert wf.in_flight == 0 and ex.pending_data() == []
        stat = ex.get_stats()
        assert (stat.enqueued, stat.running, stat.accepted) == (0, 0, 0)
        assert ex.max_concurrent_rollouts == 4 and ex.consumer_batch_size == 2
        # the loop runs again: a new batch is made of new rollouts only
        out = ex.prepare_batch(list_loader(4, 2), wf, timeout=10)
        assert sorted(out["uid"].tolist()) == [0, 1]
    finally:
        ex.destroy()
