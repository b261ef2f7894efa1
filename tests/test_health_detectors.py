"""Run health's detectors and monitor on synthetic statistic series (no trainer).

The integration runs on the tiny model are in ``tests/test_run_health_alarms.py``.
"""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from areal.api.cli_args import GRPOConfig, RunHealthConfig
from areal.api.health_config import ACTIONABLE_ALARMS, ALARMS
from areal.utils import health_detectors as hd
from areal.utils.run_health import RunHealthMonitor, batch_signals
from areal.utils.stats_logger import health_marks

K = {
    "entropy": "ppo_actor/update/entropy/avg",
    "reward": "batch/reward",
    "length": "batch/gen_len",
    "truncation": "rollout/no_eos",
    "iw": "ppo_actor/update/importance_weight/avg",
    "kl": "ppo_actor/update/approx_kl/avg",
    "clip": "ppo_actor/update/clip_ratio/avg",
    "mismatch": "consistency/logp_absdiff_avg",
    "no_signal": "health/signal/no_signal_share",
    "corr": "health/signal/reward_length_corr",
}


def healthy_step(rng: random.Random) -> dict[str, float]:
    """One step of a healthy run (the demo's figures with their noise)."""
    return {
        K["entropy"]: 0.06 + rng.uniform(-0.01, 0.03),
        K["reward"]: 0.5 + rng.uniform(-0.15, 0.15),
        K["length"]: 22 + rng.uniform(-2, 2),
        K["truncation"]: rng.choice([0.0, 0.0, 0.02]),
        K["iw"]: 1.0 + rng.uniform(-0.01, 0.01),
        K["kl"]: rng.uniform(-0.003, 0.003),
        K["clip"]: rng.uniform(0, 0.01),
        K["no_signal"]: rng.uniform(0.0, 0.4),
        K["corr"]: rng.uniform(-0.3, 0.3),
    }


def run(series: list[dict[str, float]], tmp_path=None, **cfg) -> RunHealthMonitor:
    m = RunHealthMonitor(RunHealthConfig(**cfg), str(tmp_path) if tmp_path else None)
    for step, stats in enumerate(series):
        m.observe(step, stats)
    return m


def starts(m: RunHealthMonitor) -> dict[str, int]:
    return {e["alarm"]: e["step"] for e in m.events if e["event"] == "start"}


def healthy(n: int, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    return [healthy_step(rng) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_healthy_series_raises_no_alarm(seed):
    m = run(healthy(200, seed))
    assert starts(m) == {}
    assert m.step_stats()["health/actionable_active"] == 0.0


def with_(series, start: int, **changes):
    out = [dict(s) for s in series]
    for s in out[start:]:
        for k, v in changes.items():
            s[K[k]] = v(s[K[k]]) if callable(v) else v
    return out


@pytest.mark.parametrize(
    ("alarm", "changes"),
    [
        ("entropy_collapse", {"entropy": 0.002}),
        ("reward_drop", {"reward": 0.02}),
        ("reward_saturation", {"reward": 1.0}),
        ("length_blowup", {"length": 60.0}),
        ("truncation_rise", {"truncation": 0.6}),
        ("truncation_high", {"truncation": 0.6}),
        ("importance_weight_blowup", {"iw": 3.0}),
        ("kl_blowup", {"kl": -0.5}),
        ("clip_fraction", {"clip": 0.5}),
        ("logprob_mismatch", {"mismatch": 0.8}),
        ("no_signal_groups", {"no_signal": 0.9}),
        ("reward_hacking", {"corr": 0.95}),
    ],
)
def test_each_detector_starts_after_its_failure_and_only_it(alarm, changes):
    series = healthy(30)
    for s in series[:20]:
        s[K["mismatch"]] = 0.0
    m = run(with_(series, 20, **changes))
    got = starts(m)
    assert alarm in got and 20 <= got[alarm] <= 23, got
    # a failure can imply another (a saturated reward leaves no signal, ...): never before
    assert all(step >= 20 for step in got.values()), got


def test_alarm_logged_once_at_start_and_once_at_clear(tmp_path):
    series = with_(healthy(40), 10, kl=lambda v: -0.5)
    for s in series[20:]:
        s[K["kl"]] = 0.001
    m = run(series, tmp_path, clear_steps=3)
    lines = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    kl = [e for e in lines if e["alarm"] == "kl_blowup"]
    assert [e["event"] for e in kl] == ["start", "clear"]
    start, clear = kl
    assert start["step"] == 10 and start["kind"] == "actionable" and start["action"] == "warn"
    assert start["metric"] == "kl" and start["threshold"] == 0.2 and start["value"] < -0.2
    assert [s for s, _ in start["recent"]] == [9, 10] and start["suggestion"]
    # the fast detectors average the last 2 steps: healthy from step 21, cleared 3 later
    assert clear["step"] == 23 and clear["started_at"] == 10
    assert m.step_stats()["health/kl_blowup"] == 0.0
    assert health_marks(str(tmp_path / "health.jsonl"))[0][:2] == (10, "kl_blowup")


def test_informational_alarms_never_ask_for_an_action():
    cfg = {"action": "stop"}
    m = RunHealthMonitor(RunHealthConfig(**cfg))
    actions = []
    for step, s in enumerate(with_(healthy(20), 10, reward=1.0, no_signal=1.0)):
        actions.append(m.observe(step, s).action)
    assert {"reward_saturation", "no_signal_groups"} <= set(starts(m))
    assert set(actions) == {"warn"}
    assert all(e["action"] == "log" for e in m.events)


def test_per_alarm_action_overrides_and_the_most_severe_wins():
    cfg = RunHealthConfig(actions={"kl_blowup": "stop", "clip_fraction": "rollback"})
    m = RunHealthMonitor(cfg)
    reports = [m.observe(i, s) for i, s in enumerate(with_(healthy(12), 8, kl=-0.9, clip=0.9))]
    assert reports[8].action == "rollback"
    assert reports[8].trigger["alarm"] == "clip_fraction"
    assert [r.action for r in reports[9:]] == ["warn"] * 3  # only starts ask


def test_missing_metric_is_not_judged_and_measured_steps_are():
    """The consistency figure exists only on steps with current-version tokens."""
    series = healthy(30)
    for i in (5, 17, 18):
        series[i][K["mismatch"]] = 0.9 if i > 10 else 0.0
    m = run(series)
    assert starts(m) == {"logprob_mismatch": 17}
    assert m.history.get("logprob_mismatch") == [(5, 0.0), (17, 0.9), (18, 0.9)]


def test_nan_values_are_skipped():
    series = healthy(20)
    for s in series:
        s[K["entropy"]] = float("nan")
    assert "entropy_collapse" not in starts(run(series))


def test_heldout_divergence_needs_a_significant_fall_and_a_rising_reward():
    def monitor(evals, reward_after, n=512):
        m = RunHealthMonitor(RunHealthConfig())
        rng = random.Random(0)
        m.add_eval(-1, {"eval/accuracy": evals[0], "eval-rollout/reward__count": n})
        for step in range(30):
            s = healthy_step(rng)
            s[K["reward"]] = 0.4 if step < 10 else reward_after
            m.observe(step, s)
            if step in (9, 19):
                m.add_eval(step, {"eval/accuracy": evals[1 + step // 10], "eval/n": n})
        return starts(m)

    assert monitor([0.3, 0.8, 0.5], reward_after=0.7) == {"heldout_divergence": 20}
    assert monitor([0.3, 0.8, 0.5], reward_after=0.4) == {}  # the reward did not rise
    assert monitor([0.3, 0.8, 0.75], reward_after=0.7) == {}  # within heldout_drop
    # 32 problems: a fall of 0.125 is within three standard errors (0.3)
    assert monitor([0.3, 0.84, 0.72], reward_after=0.7, n=32) == {}


def test_verifier_falling_while_reward_rises_is_reward_hacking():
    m = RunHealthMonitor(RunHealthConfig(verifier_key="rollout/verifier", z=0.0))
    rng = random.Random(0)
    for step in range(20):
        s = healthy_step(rng)
        s[K["reward"]] = 0.4 if step < 10 else 0.8
        s["rollout/verifier"] = 0.6 if step < 10 else 0.3
        m.observe(step, s)
    assert starts(m) == {"reward_hacking": 10}
    assert "verifier score (rollout/verifier)" in m.events[0]["detail"]


def test_rolled_back_forgets_undone_steps_and_clears_alarms(tmp_path):
    m = RunHealthMonitor(RunHealthConfig(), str(tmp_path))
    series = with_(healthy(12), 8, kl=-0.9)
    for i, s in enumerate(series):
        m.observe(i, s)
    assert m.active() == {"kl_blowup": 8}
    m.rolled_back(alarm_step=8, to_step=5, checkpoint="/c/step00000005", lr_factor=0.5, lr=1e-5)
    assert m.active() == {} and m.rollbacks == 1
    assert max(s for s, _ in m.history.get("kl")) == 5
    events = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "clear", "rollback"]
    assert events[1]["reason"] == "rollback to step 5" and events[2]["to_step"] == 5


def test_replay_after_resume_rebuilds_states_and_cuts_later_events(tmp_path):
    series = with_(healthy(12), 6, clip=0.9)
    first = RunHealthMonitor(RunHealthConfig(), str(tmp_path))
    rows = []
    for i, s in enumerate(series):
        s = dict(s, global_step=i)
        s.update(first.observe(i, s).stats)
        rows.append(s)
    assert first.active() == {"clip_fraction": 6}
    again = RunHealthMonitor(RunHealthConfig(), str(tmp_path))
    again.replay(rows[:9], last_step=8)
    assert again.active() == {"clip_fraction": 6}
    report = again.observe(9, series[9])
    assert report.events == []  # still active: no second start


def test_batch_signals_groups_correlation_and_filtered_groups():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0])
    lengths = torch.tensor([5, 5, 5, 5, 3, 9, 2, 8, 4, 4, 4, 4])
    mask = (torch.arange(10)[None, :] < lengths[:, None]).float()
    out = batch_signals({"rewards": rewards, "loss_mask": mask}, group_size=4)
    assert out["health/signal/no_signal_share"] == pytest.approx(2 / 3)
    ref = torch.corrcoef(torch.stack([rewards, lengths.float()]))[0, 1]
    assert out["health/signal/reward_length_corr"] == pytest.approx(float(ref), abs=1e-6)
    # two groups dropped by the dynamic filter count as groups without signal
    out = batch_signals({"rewards": rewards, "loss_mask": mask}, 4, n_filtered_groups=2)
    assert out["health/signal/no_signal_share"] == pytest.approx(4 / 5)
    # group ids (an agent's groups of any size) win over the group size
    ids = torch.tensor([7, 7, 7, 7, 7, 7, 7, 7, 3, 3, 3, 3])
    batch = {"rewards": rewards, "loss_mask": mask, "group_ids": ids}
    batch["no_eos"] = torch.tensor([True] + [False] * 11)
    out = batch_signals(batch, 4)
    assert out["health/signal/no_signal_share"] == pytest.approx(1 / 2)
    assert out["health/signal/truncation"] == pytest.approx(1 / 12)


def test_config_validation_names_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"RunHealthConfig.action='halt'.*'warn', 'stop'"):
        RunHealthConfig(action="halt")
    with pytest.raises(ValueError, match="actions has key 'reward_saturation'"):
        RunHealthConfig(actions={"reward_saturation": "stop"})
    with pytest.raises(ValueError, match="entropy_collapse_ratio"):
        RunHealthConfig(entropy_collapse_ratio=1.5)
    informational = {"reward_saturation", "no_signal_groups", "truncation_high"}
    assert set(ACTIONABLE_ALARMS) | informational == set(ALARMS)
    assert {d.name for d in hd.DETECTORS} == set(ALARMS)


def test_rollback_without_recover_checkpoints_is_refused_at_config_time():
    cfg = GRPOConfig(experiment_name="e", trial_name="t")
    assert cfg.run_health.enabled and cfg.run_health.action == "warn"
    with pytest.raises(ValueError, match="recover.mode='disabled' writes none"):
        GRPOConfig(
            experiment_name="e",
            trial_name="t",
            run_health=RunHealthConfig(actions={"entropy_collapse": "rollback"}),
        )


def test_per_alarm_actions_from_the_command_line(tmp_path):
    from areal.demo import build_config

    overrides = [
        "run_health.actions.entropy_collapse=rollback",
        "run_health.actions.kl_blowup=stop",
    ]
    cfg = build_config([f"--fileroot={tmp_path}", *overrides])
    assert cfg.run_health.action_for("entropy_collapse") == "rollback"
    assert cfg.run_health.action_for("kl_blowup") == "stop"
    assert cfg.run_health.action_for("clip_fraction") == "warn"


def test_measured_bad_tells_which_checkpoint_weights_were_already_bad():
    m = RunHealthMonitor(RunHealthConfig())
    for step, e in enumerate([0.3, 0.3, 0.3, 0.2, 0.01, 0.001]):
        m.observe(step, {K["entropy"]: e})
    thr = 0.2 * 0.3
    # step 4 measured the weights of checkpoint 3: already collapsed
    assert m.measured_bad("entropy_collapse", 4, thr)
    assert not m.measured_bad("entropy_collapse", 3, thr)
    assert not m.measured_bad("entropy_collapse", 99, thr)  # not measured
    assert not m.measured_bad("reward_drop", 4, 0.3)  # judges several values together


# ----------------------------------------------------------------------------- truncation_high
def _batch(truncated: int, n: int = 8) -> dict[str, torch.Tensor]:
    return {
        "rewards": torch.arange(n, dtype=torch.float32) % 2,
        "loss_mask": torch.ones(n, 4),
        "no_eos": torch.arange(n) < truncated,
    }


def test_first_step_mostly_truncated_warns_once_naming_share_and_max_new_tokens(caplog):
    m = RunHealthMonitor(RunHealthConfig())
    with caplog.at_level(logging.INFO, logger="areal"):
        for step, truncated in enumerate([5, 6, 5, 6, 6]):  # 62.5% .. 75% from step 0
            m.observe(step, batch_signals(_batch(truncated), 4))
    starts = [e for e in m.events if e["alarm"] == "truncation_high"]
    assert [(e["event"], e["step"]) for e in starts] == [("start", 0)]
    assert starts[0]["kind"] == "informational" and starts[0]["action"] == "log"
    records = [r for r in caplog.records if "truncation_high" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    text = records[0].getMessage()
    assert "62.5% of the samples hit gconfig.max_new_tokens" in text
    assert "raise gconfig.max_new_tokens" in text and "short answer" in text
    assert m.step_stats()["health/truncation_high"] == 1.0
    assert m.step_stats()["health/actionable_active"] == 0.0


def test_truncation_at_half_or_off_raises_no_truncation_high():
    for cfg, truncated in (
        (RunHealthConfig(), 4),
        (RunHealthConfig(truncation_high_share=None), 8),
    ):
        m = RunHealthMonitor(cfg)
        for step in range(3):
            m.observe(step, batch_signals(_batch(truncated), 4))
        assert not [e for e in m.events if e["alarm"] == "truncation_high"]
    with pytest.raises(ValueError, match=r"truncation_high_share=1.5 is not allowed"):
        RunHealthConfig(truncation_high_share=1.5)
