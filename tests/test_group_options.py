"""AReaL 2.0's rollout group options and sampling switches: ``gconfig.reward_normalization``,
``gconfig.drop_incomplete_group``, ``rollout.serialize_group_samples``, ``gconfig.seed``,
``rollout.deterministic_sampling``, ``optimizer.warmup_steps``."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from test_workflow_executor import FakeEngine, make_config, traj

from areal.api.cli_args import GenerationHyperparameters, OptimizerConfig
from areal.api.workflow_api import RolloutWorkflow
from areal.infra.rollout.grouped_workflow import GroupedRolloutWorkflow
from areal.infra.workflow_executor import WorkflowExecutor


class ScriptedWorkflow(RolloutWorkflow):
    """Member i returns rewards[i] (None: a failed member); records the concurrency."""

    def __init__(self, rewards):
        self.rewards = list(rewards)
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def arun_episode(self, engine, data):
        i = self.calls
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
        finally:
            self.in_flight -= 1
        r = self.rewards[i]
        return None if r is None else traj(0, 2, 3, reward=r, uid=i)


def _run(wf):
    return asyncio.run(wf.arun_episode(FakeEngine(), {}))


def test_reward_normalization_group_hand_values_and_original_kept():
    out = _run(GroupedRolloutWorkflow(ScriptedWorkflow([1, 0, 0, 0]), 4, reward_normalization=True))
    # mean 0.25, population std sqrt(0.1875) = 0.4330: 0.75 / 0.433 = 1.7321, -0.25 / 0.433
    s = math.sqrt(0.1875)
    torch.testing.assert_close(
        out["rewards"], torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(out["original_rewards"], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # all equal: (r - mean) / (0 + 1e-8) = 0
    out = _run(GroupedRolloutWorkflow(ScriptedWorkflow([1, 1]), 2, reward_normalization=True))
    assert out["rewards"].tolist() == [0.0, 0.0]
    # off: raw rewards
    out = _run(GroupedRolloutWorkflow(ScriptedWorkflow([1, 0]), 2))
    assert out["rewards"].tolist() == [1.0, 0.0] and "original_rewards" not in out


class _Interaction:
    def __init__(self, reward):
        self.reward = reward

    def to_tensor_dict(self):
        return traj(0, 1, 1, reward=self.reward)


class InteractionWorkflow(RolloutWorkflow):
    def __init__(self):
        self.calls = 0

    async def arun_episode(self, engine, data):
        i = self.calls
        self.calls += 1
        # two calls per episode; the episode's reward is its last interaction's
        return {f"e{i}-a": _Interaction(None), f"e{i}-b": _Interaction(float(i == 0) * 3.0)}


def test_reward_normalization_agent_interactions_use_last_reward_of_each_episode():
    out = _run(GroupedRolloutWorkflow(InteractionWorkflow(), 2, reward_normalization=True))
    # episode rewards 3 and 0: mean 1.5, std 1.5 -> +1, -1 (interactions without a reward
    # keep None)
    assert out["e0-b"].reward == pytest.approx(1.0) and out["e1-b"].reward == pytest.approx(-1.0)
    assert out["e0-b"].original_reward == 3.0 and out["e0-a"].reward is None


def test_drop_incomplete_group_rejects_group_with_a_failed_member():
    rewards = [1, None, 0, 1]
    out = _run(GroupedRolloutWorkflow(ScriptedWorkflow(rewards), 4))
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0]  # default: the rest is kept
    assert (
        _run(GroupedRolloutWorkflow(ScriptedWorkflow(rewards), 4, drop_incomplete_group=True))
        is None
    )
    # normalisation needs the whole group as well
    assert (
        _run(GroupedRolloutWorkflow(ScriptedWorkflow(rewards), 4, reward_normalization=True))
        is None
    )


def test_serialize_runs_members_one_at_a_time():
    wf = ScriptedWorkflow([1, 0, 1, 0])
    _run(GroupedRolloutWorkflow(wf, 4))
    assert wf.max_in_flight == 4
    wf = ScriptedWorkflow([1, 0, 1, 0])
    out = _run(GroupedRolloutWorkflow(wf, 4, serialize=True))
    assert wf.max_in_flight == 1 and out["uid"].tolist() == [0, 1, 2, 3]


def test_executor_passes_group_options_and_serialize_from_config():
    ex = WorkflowExecutor(
        make_config(consumer_batch_size=1, serialize_group_samples=True), FakeEngine()
    )
    ex.initialize()
    try:
        wf = ScriptedWorkflow([1, None, 0, 1, 1, 0, 0, 0])
        # first prompt: incomplete -> dropped; second: complete, normalised
        batch = ex.rollout_batch(
            [{}, {}], wf, group_size=4, drop_incomplete_group=True, reward_normalization=True,
            timeout=30,
        )  # fmt: skip
    finally:
        ex.destroy()
    s = math.sqrt(0.1875)
    # serialized members; one group at a time (capacity 1 with consumer_batch_size=1)
    assert wf.max_in_flight == 1
    torch.testing.assert_close(
        batch["rewards"],
        torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]),
        rtol=1e-5,
        atol=0,
    )


# ----------------------------------------------------------------------- sampling switches
def test_gconfig_seed_and_workflow_options_not_sent_to_openai():
    g = GenerationHyperparameters(reward_normalization=True, drop_incomplete_group=True)
    args = g.to_openai_args_dict()
    assert "seed" not in args and "reward_normalization" not in args
    assert "drop_incomplete_group" not in args
    assert GenerationHyperparameters(seed=7).to_openai_args_dict()["seed"] == 7


def test_deterministic_sampling_sets_deterministic_and_needs_builtin_server(tmp_path, monkeypatch):
    from areal.api.cli_args import GRPOConfig, load_expr_config

    # load only (no resolved config.yaml written); monkeypatch, so no later test in this
    # process inherits RANK=1 (a gloo group of one would then refuse rank 1)
    monkeypatch.setenv("RANK", "1")
    base = ["--config", "examples/math/gsm8k_grpo_cpu.yaml", f"cluster.fileroot={tmp_path}"]
    c, _ = load_expr_config([*base, "rollout.deterministic_sampling=true"], GRPOConfig)
    assert c.deterministic and c.rollout.deterministic
    with pytest.raises(ValueError, match="deterministic_sampling"):
        load_expr_config(
            [*base, "rollout.deterministic_sampling=true", "allocation_mode=vllm:d1+fsdp:d1"],
            GRPOConfig,
        )


def test_warmup_steps_takes_precedence_over_proportion():
    from areal.engine.fsdp.parallelize import lr_lambda

    assert OptimizerConfig(warmup_steps_proportion=0.1).warmup_length(100) == 10
    oc = OptimizerConfig(warmup_steps=4, warmup_steps_proportion=0.5)
    assert oc.warmup_length(100) == 4
    f = lr_lambda("constant", 100, oc.warmup_length(100), 0.0)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert OptimizerConfig(warmup_steps=0).warmup_length(100) == 0
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimizerConfig(warmup_steps=-1)
