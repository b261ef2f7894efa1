"""``deterministic: true``: the schedule, the executor's order and seeds, the server's solo
requests, and two real runs (the demo at eta = 2, a multi-turn run) that agree bit for bit.

The design (``areal.infra.rollout.deterministic_schedule``): wave ``k`` = batch ``k``, served
by weight version ``max(0, k - eta)``, in rounds (``batch_size`` new rows, then as many new
rows as groups were rejected); batch ``k`` holds its accepted groups in submission order;
sampling seeds come from (run seed, data index, group member, turn).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import subprocess
import sys
import threading

import pytest
import torch
from test_workflow_executor import FakeEngine  # a thread-safe weight version

from areal.api.workflow_api import RolloutWorkflow
from areal.infra.rollout import workflow_context
from areal.infra.rollout.deterministic_schedule import DeterministicSchedule, ScheduleError
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils.seeding import request_seed, set_random_seed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- the schedule
def test_schedule_pins_wave_k_to_version_k_minus_eta_and_replaces_rejections_in_rounds():
    s = DeterministicSchedule(batch_size=2, max_head_offpolicyness=2)
    assert [s.pinned_version(k) for k in range(5)] == [0, 0, 0, 1, 2]
    assert s.last_wave_pinned_to(0) == 2 and s.last_wave_pinned_to(3) == 5
    r = s.next_round(0)
    assert (r.wave, r.retry, r.n_new) == (0, [], 2)
    s.on_submitted(0, 10)
    s.on_submitted(0, 11)
    assert s.next_round(0) is None  # the round is still running
    s.on_finished(11, result="b")  # finishes first: order of arrival must not matter
    s.on_finished(10, result=None)  # rejected: one more row in the next round
    r = s.next_round(0)
    assert (r.wave, r.n_new) == (0, 1)
    s.on_submitted(0, 12)
    s.on_finished(12, retry_row=(7, {"row": 7}))  # no server: this row again
    r = s.next_round(0)
    assert (r.wave, r.retry, r.n_new) == (0, [(7, {"row": 7})], 0)
    s.on_submitted(0, 13)
    s.on_finished(13, result="a")
    r = s.next_round(0)  # wave 0 complete; wave 1 (also version 0) opens
    assert s.is_complete(0) and (r.wave, r.n_new) == (1, 2)
    assert s.take(0) == ["b", "a"]  # submission (task id) order: 11 before 13
    for t in (20, 21):
        s.on_submitted(1, t)
        s.on_finished(t, result=t)
    assert s.next_round(0).wave == 2
    for t in (30, 31):
        s.on_submitted(2, t)
        s.on_finished(t, result=t)
    assert s.next_round(0) is None and s.is_complete(2)  # wave 3 waits for version 1
    assert s.next_round(1).wave == 3
    with pytest.raises(ScheduleError, match="wave 3 is pinned to weight version 1"):
        s.on_submitted(3, 40)
        s.next_round(2)  # the weights moved on before wave 3 finished


def test_schedule_refuses_bad_sizes():
    with pytest.raises(ValueError, match="batch_size=0"):
        DeterministicSchedule(0, 1)
    with pytest.raises(ValueError, match="max_head_offpolicyness=-1"):
        DeterministicSchedule(2, -1)


def test_config_deterministic_validated_and_handed_to_rollout():
    from areal.api.cli_args import GRPOConfig

    cfg = GRPOConfig(experiment_name="e", trial_name="t", deterministic=True)
    assert cfg.rollout.deterministic is True
    with pytest.raises(ValueError, match="deterministic='yes'; allowed: true or false"):
        GRPOConfig(experiment_name="e", trial_name="t", deterministic="yes")
    with pytest.raises(ValueError, match="needs the built-in inference server"):
        GRPOConfig(
            experiment_name="e",
            trial_name="t",
            deterministic=True,
            allocation_mode="vllm:d1+fsdp:d1",
        )
    from areal.api.health_config import RunHealthConfig
    from areal.api.utils_config import RecoverConfig

    with pytest.raises(ValueError, match="rollback rewinds the pinned rollout schedule"):
        GRPOConfig(
            experiment_name="e",
            trial_name="t",
            deterministic=True,
            recover=RecoverConfig(mode="on", freq_steps=1),
            run_health=RunHealthConfig(actions={"kl_blowup": "rollback"}),
        )


# --------------------------------------------------------------------------- the executor
class RecordingWorkflow(RolloutWorkflow):
    """Random latency (so finishing order differs from submission order); rejects rows
    whose uid is a multiple of 5; records what each episode saw."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.seen: dict[int, tuple] = {}
        self.finish_order: list[int] = []

    async def arun_episode(self, engine, data):
        ctx = workflow_context.get()
        version = engine.get_version()
        seed = request_seed(*workflow_context.seed_parts([1, 2, 3], version))
        self.seen[data["uid"]] = (ctx.data_index, version, seed)
        await asyncio.sleep(self.rng.uniform(0.0, 0.03))
        self.finish_order.append(data["uid"])
        if data["uid"] % 5 == 0:
            return None
        T = 3
        return dict(
            input_ids=torch.full((1, T), data["uid"]),
            attention_mask=torch.ones(1, T, dtype=torch.long),
            rewards=torch.tensor([float(data["uid"])]),
        )


def _expected_waves(n_batches: int, B: int) -> list[list[int]]:
    """Rows drawn in order; a wave takes B rows, then one more per rejected row, round by
    round; its batch is its accepted rows in order."""
    nxt, waves = 0, []
    for _ in range(n_batches):
        accepted, need = [], B
        while need:
            rows = list(range(nxt, nxt + need))
            nxt += need
            accepted += [u for u in rows if u % 5]
            need = B - len(accepted)
        waves.append(accepted)
    return waves


def _run_executor(seed: int, n_batches: int = 6, B: int = 4, eta: int = 2):
    from areal.api.cli_args import InferenceEngineConfig

    set_random_seed(1)
    engine = FakeEngine()
    cfg = InferenceEngineConfig(
        consumer_batch_size=B,
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=3,  # fewer than a round: tasks queue
        deterministic=True,
    )
    loader = [[{"uid": j * B + i} for i in range(B)] for j in range(100)]
    wf = RecordingWorkflow(random.Random(seed))
    ex = WorkflowExecutor(cfg, engine)
    ex.initialize()
    batches = []
    try:
        for k in range(n_batches):
            batch = ex.prepare_batch(loader, wf)
            batches.append(batch["rewards"].long().tolist())
            assert ex.last_submit_versions == [max(0, k - eta)] * B
            ex.wait_for_pinned_waves(k)
            engine.set_version(k + 1)
    finally:
        ex.destroy()
    return batches, wf


def test_executor_deterministic_batches_in_submission_order_at_pinned_versions():
    B, eta = 4, 2
    batches, wf = _run_executor(seed=0, B=B, eta=eta)
    expected = _expected_waves(len(batches), B)
    assert batches == expected
    for k, wave in enumerate(expected):
        for uid in wave:  # every row of batch k ran at version max(0, k - eta)
            assert wf.seen[uid][1] == max(0, k - eta)
    # seeds: (run seed, data index, group member), the data index = place in the draw order
    for uid, (data_index, _, seed) in wf.seen.items():
        assert data_index == uid
        assert seed == request_seed("deterministic", uid, 0)
    assert wf.finish_order != sorted(wf.finish_order)  # arrival order did differ
    again, wf2 = _run_executor(seed=1, B=B, eta=eta)
    assert again == batches and wf2.finish_order != wf.finish_order


def test_executor_wait_for_pinned_waves_refuses_when_paused():
    from areal.api.cli_args import InferenceEngineConfig

    cfg = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=1, deterministic=True)
    ex = WorkflowExecutor(cfg, FakeEngine())
    ex.initialize()
    try:
        loader = [[{"uid": 2 * j + 1}, {"uid": 2 * j + 2}] for j in range(50)]
        ex.prepare_batch(loader, RecordingWorkflow(random.Random(0)))
        ex.pause()
        with pytest.raises(RuntimeError, match="paused"):
            ex.wait_for_pinned_waves(0, timeout=5)
    finally:
        ex.destroy()


# --------------------------------------------------------------------------- the server
def test_core_deterministic_request_same_result_alone_or_among_others(tiny_model_dir):
    from _hf_reference import hf_model

    from areal.inference.server.core import GenerationCore, SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(3, 400) for _ in range(11)]
    det = SamplingParams(max_new_tokens=12, seed=123, deterministic=True, ignore_eos=True)

    def run(n_others: int) -> dict:
        core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=16)
        results: dict[str, dict] = {}
        done = threading.Event()
        n = n_others + 1

        def cb(r):
            results[r["rid"]] = r
            if len(results) == n:
                done.set()

        try:
            # the core checks its fast decoder against the HF forward on its first decode
            # step (which rewrites that step's cache column): done first in both runs
            warm = threading.Event()
            core.submit("warm", prompt[:4], SamplingParams(max_new_tokens=2), lambda r: warm.set())
            assert warm.wait(60)
            for i in range(n_others):  # others in flight before, beside and after
                other = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 30))]
                core.submit(f"o{i}", other, SamplingParams(max_new_tokens=20, seed=i), cb)
                if i == n_others // 2:
                    core.submit("det", prompt, det, cb)
            if n_others == 0:
                core.submit("det", prompt, det, cb)
            assert done.wait(120)
        finally:
            core.shutdown()
        return results["det"]

    alone, crowded = run(0), run(8)
    assert alone["output_ids"] == crowded["output_ids"]
    assert alone["output_logprobs"] == crowded["output_logprobs"]  # bit-identical floats


# --------------------------------------------------------------------------- real runs
DEMO = [os.path.join(REPO, "examples", "math", "gsm8k_rl.py"),
        os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml")]  # fmt: skip
MULTI_TURN = [os.path.join(REPO, "examples", "multi_turn_math", "gsm8k_rl_mt.py"),
              os.path.join(REPO, "examples", "multi_turn_math", "gsm8k_grpo_mt_cpu.yaml")]  # fmt: skip
STEPS = 3


def _cmd(example: list[str], fileroot: str) -> list[str]:
    return [
        sys.executable, example[0], "--config", example[1],
        f"cluster.fileroot={fileroot}",
        f"total_train_steps={STEPS}",
        "deterministic=true",
        "rollout.max_head_offpolicyness=2",
        "train_dataset.path=synthetic://arith?digits=1&steps=2&n=400&seed=7",
        "train_dataset.batch_size=2",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=12",
        "valid_dataset=null",
        "recover.mode=disabled",
        f"saver.freq_steps={STEPS}",
    ]  # fmt: skip


def _outcome(root: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    (stats,) = glob.glob(f"{root}/logs/*/*/stats.jsonl")
    with open(stats) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    (ckpt,) = glob.glob(f"{root}/checkpoints/*/*/default/*/model.safetensors")
    return rows, load_file(ckpt)


def _per_step(rows: list[dict]) -> list[tuple]:
    keys = ("loss", "batch/reward", "ppo_actor/update/actor_loss/avg", "rollout/staleness_max")
    return [(r["global_step"], *(r[k] for k in keys)) for r in rows]


@pytest.mark.slow
def test_two_deterministic_runs_demo_eta2_and_multi_turn_bit_identical(tmp_path):
    """Four runs at once (two demo, two multi-turn; each with its own server and worker):
    the two of each kind must agree on every per-step loss and on every final tensor."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for kind, example in (("demo", DEMO), ("mt", MULTI_TURN)):
        for i in (1, 2):
            root = str(tmp_path / f"{kind}{i}")
            log = open(tmp_path / f"{kind}{i}.log", "w")
            runs[(kind, i)] = (
                root,
                log,
                subprocess.Popen(
                    _cmd(example, root),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env=env,
                    start_new_session=True,
                ),  # fmt: skip
            )
    try:
        for _, log, proc in runs.values():
            rc = proc.wait(timeout=600)
            log.close()
            assert rc == 0, open(log.name).read()[-3000:]
    finally:
        for _, _, proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)
    for kind in ("demo", "mt"):
        rows1, w1 = _outcome(runs[(kind, 1)][0])
        rows2, w2 = _outcome(runs[(kind, 2)][0])
        assert len(rows1) == STEPS, kind
        assert _per_step(rows1) == _per_step(rows2), kind
        # batch k was generated by version max(0, k - 2): lags 0, 1, 2
        assert [r["rollout/staleness_max"] for r in rows1] == [0.0, 1.0, 2.0], kind
        assert sorted(w1) == sorted(w2)
        assert all(torch.equal(w1[k], w2[k]) for k in w1), kind
