"""Runs stop when they should: episodes that keep failing, SIGTERM while waiting for a batch.

Real components: the built-in server on 127.0.0.1 refusing every prompt longer than the
model's context, the real ``WorkflowExecutor``, a real ``PPOTrainer`` (RPC worker +
server), and a real controller subprocess stopped by a real SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _jsonl import read_jsonl

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.infra.rollout.failure_monitor import EpisodeFailureMonitor, RolloutFailureError
from areal.utils.evaluator import run_evaluation
from areal.workflow.rlvr import RLVRWorkflow

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = pytest.mark.serial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_YAML = os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml")
TRAINER_SCRIPT = os.path.join(REPO, "tests", "_run_health_trainer.py")
REWARD = "areal.reward.gsm8k.gsm8k_reward_fn"


# ----------------------------------------------------------------------------- the monitor
def test_monitor_all_of_last_n_failed_trips_with_the_most_common_failure():
    m = EpisodeFailureMonitor("training", max_consecutive=4, window=100, max_ratio=None)
    m.record_ok()
    for port in (1, 2, 3):  # differ only in numbers: one failure
        m.record_failure(ValueError(f"HTTP 400 from 127.0.0.1:{port}: prompt too long"))
        m.raise_if_tripped()
    m.record_failure(KeyError("x"))
    with pytest.raises(RolloutFailureError) as ei:
        m.raise_if_tripped()
    msg = str(ei.value)
    assert "the last 4 training episodes all failed" in msg
    assert "rollout.max_consecutive_episode_failures=4" in msg
    assert "3 of these 4 episodes: ValueError: HTTP 400 from 127.0.0.1:1: prompt too long" in msg
    assert "4 of 5 training episodes failed in all" in msg


def test_monitor_share_over_window_trips_and_occasional_failures_do_not():
    m = EpisodeFailureMonitor("training", max_consecutive=None, window=10, max_ratio=0.5)
    for i in range(200):  # 1 in 5 fails: never trips, every failure counted
        (m.record_failure(RuntimeError("boom")) if i % 5 == 4 else m.record_ok())
    m.raise_if_tripped()
    assert m.take_failed() == 40 and m.take_failed() == 0
    for i in range(10):  # 6 of the last 10 failed: more than half
        (m.record_failure(RuntimeError("boom")) if i % 5 < 3 else m.record_ok())
    with pytest.raises(RolloutFailureError, match="6 of the last 10 training episodes failed"):
        m.raise_if_tripped()


def test_monitor_rejections_in_a_row_trip_and_one_accepted_episode_resets_them():
    m = EpisodeFailureMonitor(
        "training", max_consecutive=4, window=100, max_ratio=0.5, max_consecutive_rejections=5
    )
    for _ in range(3):
        for _ in range(4):
            m.record_ok(rejected="filtered")
        m.record_ok(rejected="stale")  # regenerated: not counted
        m.record_ok()  # accepted: the count starts again
    m.raise_if_tripped()
    for reason in ("filtered", "filtered", "none", "filtered"):
        m.record_ok(rejected=reason)
        m.raise_if_tripped()
    m.record_ok(rejected="filtered")
    with pytest.raises(RolloutFailureError) as ei:
        m.raise_if_tripped()
    msg = str(ei.value)
    assert "the last 5 finished episodes were all rejected" in msg, msg
    assert "rollout.max_consecutive_rejections=5" in msg
    assert "4 filtered out by the accept filter" in msg and "1 returned None" in msg
    assert m.failed_total == 0  # rejections are not failures
    with pytest.raises(ValueError, match="max_consecutive_rejections=0"):
        EpisodeFailureMonitor("training", 4, 100, 0.5, max_consecutive_rejections=0)


def test_evaluation_whose_episodes_all_fail_raises_the_failure():
    async def episode(row):
        raise ConnectionRefusedError(f"reward service down for row {row}")

    monitor = EpisodeFailureMonitor("evaluation", max_consecutive=64, window=256, max_ratio=0.5)
    with pytest.raises(RolloutFailureError) as ei:
        run_evaluation(episode, list(range(5)), failure_monitor=monitor)
    assert "all 5 evaluation episodes failed" in str(ei.value)
    assert "5 of these 5 episodes: ConnectionRefusedError: reward service down" in str(ei.value)

    async def flaky(row):
        if row % 5 == 4:
            raise RuntimeError("flaky")
        return {"rewards": torch.ones(1)}

    monitor = EpisodeFailureMonitor("evaluation", max_consecutive=64, window=10, max_ratio=0.5)
    res = run_evaluation(flaky, list(range(20)), failure_monitor=monitor)
    assert res["eval/n_failed"] == 4 and res["eval/n"] == 16


class _VersionZero:
    """The executor only asks an inference engine for its version here."""

    def get_version(self) -> int:
        return 0


class _Versioned:
    """An inference engine's version, bumped by the test as a trainer's step would."""

    version = 0

    def get_version(self) -> int:
        return self.version


class _Raises:
    async def arun_episode(self, engine, data):
        raise KeyError(f"row {data['i']} has no 'messages'")


class _ReturnsNone:
    async def arun_episode(self, engine, data):
        return None


def test_executor_workflow_raising_every_time_stops_the_wait_and_the_loop():
    from areal.infra.rollout.workflow_executor import WorkflowExecutor

    cfg = InferenceEngineConfig(
        consumer_batch_size=2, max_concurrent_rollouts=2, max_consecutive_episode_failures=5
    )
    loader = [[{"i": 2 * k}, {"i": 2 * k + 1}] for k in range(10_000)]
    with WorkflowExecutor(cfg, _VersionZero()) as ex:
        with pytest.raises(RolloutFailureError) as ei:
            ex.prepare_batch(loader, workflow=_Raises(), timeout=30)
        assert "5 of these 5 episodes: KeyError:" in str(ei.value)
        time.sleep(0.3)  # the ones running at the trip finish
        n = ex.rejection_reasons["error"]
        assert 5 <= n <= 5 + 2, n
        time.sleep(0.3)
        assert ex.rejection_reasons["error"] == n  # nothing new started


def test_executor_rejections_are_not_failures():
    from areal.infra.rollout.workflow_executor import WorkflowExecutor

    cfg = InferenceEngineConfig(
        consumer_batch_size=2,
        max_concurrent_rollouts=2,
        max_consecutive_episode_failures=5,
        max_consecutive_rejections=None,
    )
    loader = [[{"i": 2 * k}, {"i": 2 * k + 1}] for k in range(10_000)]
    with WorkflowExecutor(cfg, _VersionZero()) as ex:
        with pytest.raises(TimeoutError):  # no batch ever, but no failure either
            ex.prepare_batch(loader, workflow=_ReturnsNone(), timeout=1.5)
        assert ex.rejection_reasons["none"] > 5
        assert ex.failures.failed_total == 0 and not ex.failures.tripped


class _Reward:
    """One row whose reward is 1 for every third data item, else 0."""

    async def arun_episode(self, engine, data):
        reward = float(data["i"] % 3 == 0)
        return {"input_ids": torch.ones(1, 3, dtype=torch.long), "rewards": torch.tensor([reward])}


def test_executor_filter_dropping_every_group_stops_the_wait_instead_of_waiting_forever():
    """Dynamic sampling on a task the model never solves: every group is filtered, the
    batch never fills; the wait raises after max_consecutive_rejections, naming the
    filter (no per-step bound here: max_num_gen_batches=null; with it the step trains on
    filtered groups, tests/test_generation_bound.py). A filter that lets some groups
    through never trips it."""
    from areal.infra.rollout.workflow_executor import WorkflowExecutor

    cfg = InferenceEngineConfig(
        consumer_batch_size=2,
        max_concurrent_rollouts=2,
        max_consecutive_rejections=50,
        max_num_gen_batches=None,
    )
    loader = [[{"i": 2 * k}, {"i": 2 * k + 1}] for k in range(10_000)]
    with WorkflowExecutor(cfg, _VersionZero()) as ex:
        t0 = time.monotonic()
        with pytest.raises(RolloutFailureError) as ei:
            ex.prepare_batch(
                loader, workflow=_Reward(), should_accept_fn=lambda t: False, timeout=60
            )
        assert time.monotonic() - t0 < 30
        assert "the last 50 finished episodes were all rejected" in str(ei.value)
        assert "50 filtered out by the accept filter" in str(ei.value)
        time.sleep(0.3)
        n = ex.rejection_reasons["filtered"]
        assert 50 <= n <= 50 + 2, n  # no more rollouts start
        time.sleep(0.3)
        assert ex.rejection_reasons["filtered"] == n
    engine = _Versioned()
    with WorkflowExecutor(cfg, engine) as ex:
        for _ in range(20):  # two of every three filtered: batches keep coming
            engine.version += 1  # a trainer step: the staleness bound allows the next batch
            batch = ex.prepare_batch(
                loader,
                workflow=_Reward(),
                should_accept_fn=lambda t: bool(t["rewards"].sum() > 0),
                timeout=30,
            )
            assert batch["rewards"].tolist() == [1.0, 1.0]
        assert ex.rejection_reasons["filtered"] >= 30 and not ex.failures.tripped


# ----------------------------------------------------------------------------- real server
def _long_rows(n: int) -> list[dict]:
    """Rows whose prompt (~2,000 tokens) exceeds the tiny model's 1,024 positions."""
    return [
        {"messages": [{"role": "user", "content": "7 + " * 1000 + f"{i} = ?"}], "answer": "7"}
        for i in range(n)
    ]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_model_call_refused_stops_prepare_batch_within_the_window(tiny_lm_dir):
    """The server answers 400 (prompt longer than the context) to every call: the wait
    raises RolloutFailureError after 8 failed episodes (plus those already running),
    quoting the server's answer, instead of resubmitting forever."""
    from areal.inference.clients.local import RemoteLocalEngine

    cfg = InferenceEngineConfig(
        setup_timeout=120,
        consumer_batch_size=4,
        max_concurrent_rollouts=4,
        max_consecutive_episode_failures=8,
    )
    eng = RemoteLocalEngine(cfg)
    eng.launch_server({"model_path": tiny_lm_dir})
    try:
        eng.initialize()
        wf = RLVRWorkflow(
            reward_fn=REWARD,
            gconfig=GenerationHyperparameters(max_new_tokens=4),
            tokenizer=tiny_lm_dir,
        )
        loader = [_long_rows(4) for _ in range(500)]
        t0 = time.monotonic()
        with pytest.raises(RolloutFailureError) as ei:
            eng.prepare_batch(loader, workflow=wf)
        elapsed = time.monotonic() - t0
        msg = str(ei.value)
        assert "the last 8 training episodes all failed" in msg, msg
        assert "8 of these 8 episodes: ValueError: HTTP 400 from 127.0.0.1:" in msg, msg
        assert "the model's context length is 1024" in msg, msg
        assert elapsed < 60, elapsed
        time.sleep(1.0)  # the ones running at the trip finish
        errors = eng.workflow_executor.rejection_reasons["error"]
        assert 8 <= errors <= 8 + 4, errors  # stopped: nothing new started after the 8th
        time.sleep(0.5)  # the loop starts nothing any more
        assert eng.workflow_executor.rejection_reasons["error"] == errors
        with pytest.raises(RolloutFailureError):  # every later wait says so too
            eng.wait(1, timeout=5)
    finally:
        eng.destroy()
        eng.teardown_server()


# ----------------------------------------------------------------------------- PPOTrainer
def _trainer_cmd(mode: str, fileroot: str) -> list[str]:
    return [
        sys.executable, TRAINER_SCRIPT, mode, "--config", DEMO_YAML,
        f"cluster.fileroot={fileroot}",
        "total_train_steps=3",
        "train_dataset.path=synthetic://arith?digits=1&steps=2&n=256&seed=3",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        "actor.dynamic_sampling=false",
        "valid_dataset=null",
        "evaluator.eval_before_train=false",
        "rollout.max_concurrent_rollouts=8",
        "rollout.max_head_offpolicyness=0",
        "rollout.max_consecutive_episode_failures=8",
        "rollout.episode_failure_window=10",
        "rollout.max_episode_failure_ratio=0.5",
        "recover.mode=auto",
        # not due after step 0: the checkpoint must come from the interrupted wait
        "recover.freq_steps=1000",
    ]  # fmt: skip


def _stats(fileroot: str) -> list[dict]:
    return read_jsonl(os.path.join(fileroot, "logs", "gsm8k-grpo-cpu", "demo", "stats.jsonl"))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_trainer_sigterm_while_waiting_resumes_and_stops_when_every_episode_fails(tmp_path):
    """Two runs of a real controller (``tests/_run_health_trainer.py``):

    1. step 0 completes although one episode in 5 raises (``rollout/n_failed`` counts
       them); step 1's rollouts never finish: SIGTERM ends the wait, the recover
       checkpoint of step 0 is written, the controller exits 143 within 30 s, no child
       left;
    2. the same command resumes at step 1 and completes it; from step 2 on every episode
       raises: the run stops with RolloutFailureError quoting the exception (exit 1).
    """
    import psutil

    from areal.utils.recover import list_complete_checkpoints, verify_checkpoint

    root = str(tmp_path / "run")
    log = str(tmp_path / "first.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _trainer_cmd("first", root),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while not _stats(root):
            assert proc.poll() is None, open(log).read()[-3000:]
            assert time.monotonic() < deadline, "step 0 never finished"
            time.sleep(0.2)
        time.sleep(2.0)  # now waiting for step 1's batch, whose rollouts hang
        children = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - t0
        text = open(log).read()
        assert rc == 128 + signal.SIGTERM, text[-3000:]
        assert took < 30, (took, text[-3000:])
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"children left after SIGTERM: {[c.pid for c in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (step0,) = _stats(root)
    assert step0["rollout/n_failed"] >= 1 and step0["batch/n_seqs"] == 8, step0
    assert "while waiting for the batch of step 1 (recover checkpoint of step 0" in text
    ckpts = list_complete_checkpoints(
        os.path.join(root, "checkpoints", "gsm8k-grpo-cpu", "demo", "recover")
    )
    assert [os.path.basename(c) for c in ckpts] == ["step00000000"], ckpts
    assert verify_checkpoint(ckpts[0]) is None

    log2 = str(tmp_path / "resumed.log")
    with open(log2, "w") as f:
        done = subprocess.run(
            _trainer_cmd("resumed", root),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            timeout=300,
        )
    text2 = open(log2).read()
    assert done.returncode == 1, text2[-3000:]
    assert "continuing at step 1" in text2, text2[-3000:]
    assert [r["global_step"] for r in _stats(root)] == [0, 1]
    # either rule may trip first (8 in a row, or more than 5 of the last 10)
    assert "RolloutFailureError: training episodes keep failing" in text2, text2[-3000:]
    assert "RuntimeError: simulated sandbox unreachable at 10.0.0.7:8080" in text2
