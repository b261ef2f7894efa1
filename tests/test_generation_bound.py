"""The per-step bound on generation when groups are filtered (``rollout.max_num_gen_batches``,
``areal/infra/rollout/generation_bound.py``).

The executor runs for real (its loop, the staleness bound, the dynamic-sampling filter
``dynamic_sampling_accept``) on a workflow whose groups carry no signal; the slow tests
run the trainer (real server and worker, tiny model) with a reward that is always 0.
The first-step truncation warning is tested in ``tests/test_health_detectors.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import torch

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.rollout.generation_bound import GenerationBound, GroupTally
from areal.infra.rollout.workflow_executor import WorkflowExecutor
from areal.utils import stats_tracker

DYNAMIC_SAMPLING = "areal.utils.functional.dynamic_sampling_accept"


class _Engine:
    """The executor's view of an inference engine: a weight version."""

    def __init__(self) -> None:
        self.version = 0
        self._lock = threading.Lock()

    def get_version(self) -> int:
        with self._lock:
            return self.version


class _NoSignal:
    """One sample per call; reward 0 (a task too hard for the model) except for items
    with ``solved`` (reward 1: too easy); ``no_eos`` True for samples with an odd index
    (every other sample hit max_new_tokens); ``mixed`` items get rewards 0, 1, 0, 1."""

    def __init__(self) -> None:
        self.calls = 0

    async def arun_episode(self, engine, data):
        from areal.infra import workflow_context

        self.calls += 1
        k = workflow_context.get().sample_index
        await asyncio.sleep(0.001)
        reward = float(k % 2) if data.get("mixed") else float(bool(data.get("solved")))
        return {
            "input_ids": torch.ones(1, 4, dtype=torch.long),
            "attention_mask": torch.ones(1, 4, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 0, 1, 1]]),
            "rewards": torch.tensor([reward]),
            "no_eos": torch.tensor([k % 2 == 1]),
            "uid": torch.tensor([data["uid"]]),
        }


def _loader(n: int, batch: int, **extra) -> list[list[dict]]:
    items = [dict(uid=i, **extra) for i in range(n)]
    return [items[i : i + batch] for i in range(0, n, batch)]


def _executor(**cfg) -> WorkflowExecutor:
    base = dict(consumer_batch_size=4, max_concurrent_rollouts=4, max_head_offpolicyness=0)
    ex = WorkflowExecutor(InferenceEngineConfig(**{**base, **cfg}), _Engine())
    ex.initialize()
    return ex


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_step_without_signal_ends_at_bound_with_warning_and_stat(caplog):
    """Every group all-zero (3 in 4) or all-one: the filter drops them all; the step ends
    after max_num_gen_batches x batch groups, trains on filtered groups (the batch keeps
    its size) and warns with the figures, instead of generating until the run stops."""
    ex = _executor(max_num_gen_batches=3)
    loader = _loader(400, 4)
    for batch in loader:
        batch[3]["solved"] = True  # one group in 4 is solved by every sample
    wf = _NoSignal()
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="areal"):
            batch = ex.prepare_batch(
                loader, wf, should_accept_fn=DYNAMIC_SAMPLING, group_size=4, timeout=30
            )
    finally:
        ex.destroy()
    assert time.monotonic() - t0 < 10
    # the batch of 4 groups x 4 samples, all filtered groups (zero advantage)
    assert batch["rewards"].shape[0] == 16
    assert batch["uid"].unique().numel() == 4
    # at most the bound (12 groups) plus those running when it was reached
    assert 12 <= wf.calls // 4 <= 12 + 4
    bound = [m for m in _warnings(caplog) if "max_num_gen_batches=3 x 4" in m]
    assert len(bound) == 2, _warnings(caplog)  # the early one (4 groups), the bound's
    early, hit = bound
    assert "only 0 of the first 4 groups of this step were accepted (4 filtered" in early
    assert "this step generated 12 groups" in hit and "only 0 passed the filter" in hit
    assert "training on the 0 accepted groups plus 4 filtered ones" in hit
    assert "12 of 12 groups (100.0%) had all rewards equal" in hit
    assert "9 all zero or below (75.0%: the task is too hard" in hit
    assert "3 all max (equal and positive, 25.0%: too easy)" in hit
    assert "24 of their 48 samples (50.0%) hit gconfig.max_new_tokens" in hit
    for advice in ("gconfig.temperature", "gconfig.n_samples", "gconfig.max_new_tokens"):
        assert advice in hit
    assert "check the reward function" in hit
    stats = stats_tracker.export_all()
    assert stats["rollout/gen_bound_hit"] == 1.0 and stats["rollout/n_filler"] == 4.0
    assert stats["rollout/n_generated"] == 12.0
    assert (stats["rollout/n_all_zero"], stats["rollout/n_all_max"]) == (9.0, 3.0)
    # the filtered groups trained on count towards the staleness bound as accepted
    assert ex.get_stats().accepted == 4 and ex.filler_total == 4


def test_step_with_few_accepted_groups_trains_them_plus_filtered_ones(caplog):
    """One group in 8 has signal: at the bound the step trains on every accepted group,
    the rest of the batch filled with filtered ones; the next step's warning is
    rate-limited (no spam) while the stat still counts it."""
    ex = _executor(max_num_gen_batches=2, consumer_batch_size=4, max_concurrent_rollouts=2)
    loader = _loader(400, 8)
    for batch in loader:
        batch[0]["mixed"] = True
    engine = ex.inference_engine
    try:
        with caplog.at_level(logging.WARNING, logger="areal"):
            batches = []
            for _ in range(2):
                batches.append(
                    ex.prepare_batch(
                        loader, _NoSignal(), should_accept_fn=DYNAMIC_SAMPLING, group_size=4
                    )
                )
                with engine._lock:
                    engine.version += 1
    finally:
        ex.destroy()
    for batch in batches:
        rewards = batch["rewards"].view(4, 4)
        mixed = sum(bool((g != g[0]).any()) for g in rewards)
        assert batch["rewards"].shape[0] == 16 and 1 <= mixed <= 2
    hits = [m for m in _warnings(caplog) if "this step generated" in m]
    assert len(hits) == 1, hits  # the second step's is rate-limited
    stats = stats_tracker.export_all()
    assert stats["rollout/gen_bound_hit"] == 1.0  # mean over the two steps: both hit it


def test_bound_off_keeps_generating_until_max_consecutive_rejections_stops_it():
    """max_num_gen_batches=null: nothing is trained on a step without signal; the run
    still never hangs: max_consecutive_rejections stops it."""
    from areal.infra.rollout.failure_monitor import RolloutFailureError

    ex = _executor(max_num_gen_batches=None, max_consecutive_rejections=20)
    try:
        with pytest.raises(RolloutFailureError, match="max_consecutive_rejections=20"):
            ex.prepare_batch(
                _loader(400, 4), _NoSignal(), should_accept_fn=DYNAMIC_SAMPLING, group_size=4,
                timeout=30,
            )  # fmt: skip
    finally:
        ex.destroy()
    assert stats_tracker.export_all().get("rollout/gen_bound_hit") is None


def test_wait_without_batch_for_a_minute_warns_with_the_step_figures(caplog, monkeypatch):
    """Whatever the bound, a step that has no batch after a minute (here 0.3 s) says what
    its groups gave so far, and what to change."""
    from areal.infra.rollout import rollout_results

    monkeypatch.setattr(rollout_results, "_NO_PROGRESS_WARN_S", 0.3)
    ex = _executor(max_num_gen_batches=None, max_consecutive_rejections=None)
    try:
        with caplog.at_level(logging.WARNING, logger="areal"):
            with pytest.raises(TimeoutError):
                ex.prepare_batch(
                    _loader(4000, 4), _NoSignal(), should_accept_fn=DYNAMIC_SAMPLING,
                    group_size=4, timeout=1.0,
                )  # fmt: skip
    finally:
        ex.destroy()
    waits = [m for m in _warnings(caplog) if m.startswith("prepare_batch: no batch after")]
    assert waits, _warnings(caplog)
    assert "finished groups: 0 accepted" in waits[0] and "all zero or below" in waits[0]
    assert "gconfig.max_new_tokens" in waits[0] and "check the reward function" in waits[0]


def test_bound_with_none_results_waits_and_warns_once(caplog):
    """A workflow returning None gives nothing to fill with: the step warns once at the
    bound that it cannot fill, and the rejections in a row stop it."""
    from areal.infra.rollout.failure_monitor import RolloutFailureError

    class _None:
        async def arun_episode(self, engine, data):
            await asyncio.sleep(0.05)  # the bound (8) well before the 40 in a row
            return None

    ex = _executor(max_num_gen_batches=2, max_consecutive_rejections=40)
    try:
        with caplog.at_level(logging.WARNING, logger="areal"):
            with pytest.raises(RolloutFailureError):
                ex.prepare_batch(_loader(400, 4), _None(), timeout=30)
    finally:
        ex.destroy()
    hits = [m for m in _warnings(caplog) if "this step generated" in m]
    assert len(hits) == 1 and "no filtered group was kept" in hits[0], hits


def test_sync_fill_at_gen_bound_below_bound_none_then_filtered_groups():
    """The synchronous trainer's path: rollout_batch draws, then fill_at_gen_bound."""
    ex = _executor(max_num_gen_batches=2)
    wf = _NoSignal()
    try:
        first = ex.rollout_batch(
            [dict(uid=i) for i in range(4)], wf, should_accept_fn=DYNAMIC_SAMPLING, group_size=4
        )
        assert first == {}
        assert ex.fill_at_gen_bound(4, 4) is None  # 4 groups < 2 x 4
        ex.rollout_batch(
            [dict(uid=i) for i in range(4, 8)], wf, should_accept_fn=DYNAMIC_SAMPLING,
            group_size=4,
        )  # fmt: skip
        filler = ex.fill_at_gen_bound(4, 4)
        ex.end_step()
    finally:
        ex.destroy()
    assert filler["rewards"].shape[0] == 16
    stats = stats_tracker.export_all()
    assert stats["rollout/gen_bound_hit"] == 1.0 and stats["rollout/n_generated"] == 8.0


def test_early_warning_at_a_quarter_accepted_fires_above_it_not():
    mixed = {"rewards": torch.tensor([0.0, 1.0])}
    flat = {"rewards": torch.zeros(2)}
    for accepted, fires in ((2, True), (3, False)):  # 2 of 8: a quarter
        gb = GenerationBound(4)
        reasons = [None] * accepted + ["filtered"] * (8 - accepted)
        out = [gb.on_finished(mixed if r is None else flat, r, None, 8) for r in reasons]
        assert (out[-1] is not None) == fires and out[:-1] == [None] * 7
        if fires:
            assert f"only {accepted} of the first 8 groups" in out[-1]


def test_group_tally_counts_episodes_not_rows():
    t = GroupTally()
    # an agent episode exported as 3 rows: the episodes' rewards (first rows) 1, 1
    t.add(
        {"rewards": torch.tensor([1.0, 0.5, 0.2, 1.0]), "episode_ids": torch.tensor([0, 0, 0, 1])},
        "filtered",
    )
    t.add({"rewards": torch.tensor([0.0])}, None)  # one sample: nothing to compare
    assert (t.groups, t.filtered, t.accepted, t.all_max, t.all_zero) == (2, 1, 1, 1, 0)
    assert "truncation unknown" in t.describe()
    assert "harder prompts" in t.advice()  # all-max groups: too easy, not too hard
    t.add({"rewards": torch.zeros(4)}, "filtered")
    t.add({"rewards": torch.zeros(4)}, "filtered")
    assert "an easier task" in t.advice() and t.all_zero == 2


def test_max_num_gen_batches_validation_names_field_and_allowed():
    with pytest.raises(ValueError, match=r"max_num_gen_batches=0 is not allowed; must be >= 1"):
        InferenceEngineConfig(max_num_gen_batches=0)
    assert InferenceEngineConfig().max_num_gen_batches == 4
    assert InferenceEngineConfig(max_num_gen_batches=None).max_num_gen_batches is None
    with pytest.raises(ValueError, match="max_num_gen_batches"):
        GenerationBound(0)


# ----------------------------------------------------------------------------- trainer
def zero_reward_fn(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    """A task the model never solves (or a reward that cannot read its answers)."""
    return 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_training", [True, False])
def test_trainer_step_without_signal_trains_at_bound_and_logs_cause(
    tiny_lm_dir, tmp_path, caplog, async_training
):
    """The demo config with dynamic sampling and a reward that is always 0: the first step
    ends at the bound (4 x 4 groups) instead of generating until the run stops, its stats
    row shows it, the warning names the all-zero groups."""
    from test_rl_trainer import _grpo_config, _rows

    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=1",
        "actor.dynamic_sampling=true",
        f"async_training={str(async_training).lower()}",
        "evaluator.eval_before_train=false",
        "evaluator.freq_steps=null",
    )
    assert cfg.rollout.max_num_gen_batches == 4 and cfg.train_dataset.batch_size == 4
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    kwargs = dict(
        reward_fn=f"{__name__}.zero_reward_fn", gconfig=cfg.gconfig, tokenizer=cfg.tokenizer_path
    )
    with caplog.at_level(logging.WARNING, logger="areal"):
        with PPOTrainer(cfg, train_dataset=train) as trainer:
            result = trainer.train("areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=kwargs)
            filtered = trainer.rollout.workflow_executor.rejection_reasons["filtered"]
    (row,) = _rows(result["log_dir"])
    assert row["rollout/gen_bound_hit"] == 1.0 and row["rollout/n_filler"] == 4.0
    assert 16 <= row["rollout/n_generated"] == row["rollout/n_all_zero"] <= 16 + 4
    assert row["health/signal/no_signal_share"] == 1.0
    assert 16 <= filtered <= 16 + 4 + 16  # async: the next step's groups may have started
    hit = [m for m in _warnings(caplog) if "this step generated" in m]
    assert len(hit) == 1 and "all zero or below (100.0%" in hit[0], hit
