"""Run health on real runs of the tiny model: each alarm raised by inducing its failure.

Three trainer runs (real servers, workers, weight syncs; ``tests/_health_runs.py``), each
checked by several tests:

- the unmodified demo (``python -m areal.demo``, a few steps): no actionable alarm, the
  ``health/*`` stats logged;
- a scripted run (synchronous rollout, so every token is of the trainer's current version
  and the logprob consistency is measured each step): a constant reward (no group has a
  signal), then a reward paying for length (the length probe of reward hacking, responses
  running into max_new_tokens), then weight syncs that deliver noisy weights to the
  server (trainer-vs-server logprob mismatch);
- a too-high learning rate (SGD warming up to lr 3, on the un-normalised reward: no
  update for the first steps, then every sampled token reinforced) that collapses the
  entropy within a few steps, with action ``rollback``: the checkpoint from before the
  alarm is restored, the learning rate lowered, the run goes on.
"""

from __future__ import annotations

import json
import os

import pytest
from _health_runs import demo_config, run_demo
from _jsonl import read_jsonl

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def starts(events: list[dict]) -> dict[str, int]:
    return {e["alarm"]: e["step"] for e in events if e["event"] == "start"}


# ----------------------------------------------------------------------------- the demo
@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from areal import demo

    root = tmp_path_factory.mktemp("demo")
    result = demo.main(["--steps=6", "--eval-n=32", f"--fileroot={root}"])
    log_dir = result["log_dir"]
    result["health"] = read_jsonl(os.path.join(log_dir, "health.jsonl"))
    result["rows"] = read_jsonl(os.path.join(log_dir, "stats.jsonl"))
    return result


def test_unmodified_demo_raises_no_actionable_alarm(demo_run):
    actionable = [e for e in demo_run["health"] if e.get("kind") == "actionable"]
    assert actionable == [], actionable
    rows = [r for r in demo_run["rows"] if r["global_step"] >= 0]
    assert len(rows) == 6
    for r in rows:
        assert r["health/actionable_active"] == 0.0
        assert r["health/entropy_collapse"] == 0.0 and r["health/logprob_mismatch"] == 0.0
        assert 0.0 <= r["health/signal/no_signal_share"] <= 1.0


# ----------------------------------------------------------------------------- scripted
CORRUPT_FROM = 10


@pytest.fixture(scope="module")
def scripted_run(tmp_path_factory):
    cfg = demo_config(
        str(tmp_path_factory.mktemp("scripted")),
        14,
        "async_training=false",
        "actor.dynamic_sampling=false",
        # the constant phase gives zero advantages, so the rate matters from the length
        # phase on: high enough that answers grow within its six steps whatever the
        # sampled tokens (at 5e-4 one seeded run kept them at ~22 tokens)
        "actor.optimizer.lr=2e-3",
        "rollout.verify_weights=false",  # the corruption must reach the servers
        "evaluator.freq_steps=50",
    )
    return run_demo(cfg, schedule=[(0, "constant"), (4, "length")], corrupt_from=CORRUPT_FROM)


def test_constant_reward_raises_no_signal_groups(scripted_run):
    got = starts(scripted_run["health"])
    assert got["no_signal_groups"] == 0
    first = next(e for e in scripted_run["health"] if e["alarm"] == "no_signal_groups")
    assert first["kind"] == "informational" and first["action"] == "log"
    assert first["value"] == 1.0 and first["recent"] == [[0, 1.0]]
    assert scripted_run["rows"][1]["health/no_signal_groups"] == 1.0  # row 0: eval before


def test_length_reward_raises_hacking_and_length_alarms(scripted_run):
    got = starts(scripted_run["health"])
    assert 4 <= got["reward_hacking"] <= 6, got
    assert {"truncation_rise", "length_blowup"} & set(got), got
    length = min(got.get("truncation_rise", 99), got.get("length_blowup", 99))
    assert length >= 4
    hacking = next(e for e in scripted_run["health"] if e["alarm"] == "reward_hacking")
    assert hacking["value"] > 0.8 and "pays for length" in hacking["detail"]
    assert hacking["suggestion"] and hacking["action"] == "warn"


def test_corrupted_weight_sync_raises_logprob_mismatch(scripted_run):
    got = starts(scripted_run["health"])
    # the weights of version v serve the batch of step v (synchronous rollout)
    assert CORRUPT_FROM <= got["logprob_mismatch"] <= CORRUPT_FROM + 1, got
    rows = {r["global_step"]: r for r in scripted_run["rows"]}
    assert all(rows[s]["consistency/logp_absdiff_avg"] < 1e-3 for s in range(CORRUPT_FROM))
    assert rows[CORRUPT_FROM]["consistency/logp_absdiff_avg"] > 0.1
    assert rows[13]["health/logprob_mismatch"] == 1.0


def test_alarms_reach_stats_tensorboard_and_curves(scripted_run):
    log_dir = scripted_run["log_dir"]
    assert os.path.getsize(os.path.join(log_dir, "curves.png")) > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(log_dir, "tensorboard"))
    acc.Reload()
    values = {e.step: e.value for e in acc.Scalars("health/logprob_mismatch")}
    assert values[CORRUPT_FROM - 2] == 0.0 and values[13] == 1.0
    from areal.utils.stats_logger import health_marks

    marks = health_marks(os.path.join(log_dir, "health.jsonl"))
    assert (0, "no_signal_groups") in [m[:2] for m in marks]


# ----------------------------------------------------------------------------- rollback
TOTAL = 14
LR, FACTOR, WARMUP = 3.0, 0.01, 8  # linear warm-up to lr 3 over 8 steps
# zero reward (no update) before this version, constant reward from it: the collapse
# then starts at step 8 or 9 (the constant reward from step 0 collapsed it at step 5 to 8
# in CI runs, too early at 5 for a checkpoint older than the margin)
CONSTANT_FROM = 3


@pytest.fixture(scope="module")
def rollback_run(tmp_path_factory):
    cfg = demo_config(
        str(tmp_path_factory.mktemp("rollback")),
        TOTAL,
        "actor.optimizer.type=sgd",
        f"actor.optimizer.lr={LR}",
        f"actor.optimizer.warmup_steps_proportion={WARMUP / TOTAL}",
        "actor.reward_norm=null",
        "actor.dynamic_sampling=false",
        "recover.freq_steps=1",
        "rollout.max_head_offpolicyness=1",
        # the entropy falls within a step or two once the lr is high enough: at the
        # default margin (2) a CI run under load rolled back to step 2 of a collapse
        # alarmed at step 7 and stopped at the redone step 3
        "run_health.rollback_margin_steps=3",
        "run_health.actions.entropy_collapse=rollback",
        f"run_health.rollback_lr_factor={FACTOR}",
        "evaluator.freq_steps=50",
    )
    return run_demo(cfg, schedule=[(0, "zero"), (CONSTANT_FROM, "constant")])


def _rollback(run) -> dict:
    return next(e for e in run["health"] if e["event"] == "rollback")


def test_too_high_learning_rate_collapses_entropy_and_rollback_restores(rollback_run):
    events = rollback_run["health"]
    collapse = next(e for e in events if e["alarm"] == "entropy_collapse")
    assert collapse["event"] == "start" and collapse["action"] == "rollback"
    assert collapse["value"] < collapse["threshold"]
    rollback = _rollback(rollback_run)
    assert rollback["step"] == collapse["step"]
    # older than the alarm's margin: rollback_margin_steps (3) + max_head_offpolicyness (1)
    assert rollback["to_step"] <= collapse["step"] - 6
    assert rollback["checkpoint"].endswith(f"step{rollback['to_step']:08d}")
    # every alarm active then was cleared by the rollback
    cleared = [e for e in events if e.get("reason") == f"rollback to step {rollback['to_step']}"]
    assert "entropy_collapse" in {e["alarm"] for e in cleared}
    # the servers got the checkpoint's weights, at its version
    assert ("rollback", rollback["to_step"] + 1) in rollback_run["syncs"]


def test_run_continues_after_rollback_at_the_lower_learning_rate(rollback_run):
    rollback = _rollback(rollback_run)
    k = rollback["to_step"]
    rows = [r for r in rollback_run["rows"] if r["global_step"] >= 0]
    steps = [r["global_step"] for r in rows]
    events = [(e["event"], e.get("alarm"), e.get("step")) for e in rollback_run["health"]]
    # the undone steps were cut, then redone
    assert steps == list(range(TOTAL)), (rollback_run.get("health_stop"), events)
    assert rollback_run["total_steps"] == TOTAL and "health_stop" not in rollback_run
    assert [e["event"] for e in rollback_run["health"]].count("rollback") == 1
    # the learning rate of the warm-up, times the factor from the rollback on
    lrs = [r["lr"] for r in rows]
    for s, lr in enumerate(lrs):
        want = LR * min(1.0, (s + 1) / WARMUP) * (FACTOR if s > k else 1.0)
        assert lr == pytest.approx(want, rel=1e-6), (s, lrs)
    assert rollback["lr"] == pytest.approx(lrs[k + 1])  # the checkpoint's next lr, scaled
    # after the rollback the entropy collapse does not come back
    assert all(r["health/entropy_collapse"] == 0.0 for r in rows[k + 1 :])
    with open(os.path.join(rollback_run["log_dir"], "consumed.jsonl")) as f:
        consumed = [json.loads(x)["global_step"] for x in f]
    assert consumed == list(range(TOTAL))
