"""verifiers environments through the proxy (``areal.workflow.verifiers``).

The environments (``tests/_verifiers_envs.py``) are written with verifiers' public API: a
``SingleTurnEnv`` on the tiny model's word problems, a ``ToolEnv`` with the tiny tool
model's calculator, a rubric with a group reward function, a rubric that raises. Episodes
run as the trainer runs them (``OpenAIProxyWorkflow`` in inline mode, grouped), against
a real built-in server behind the real proxy; then ``PPOTrainer`` trains 3 steps on a
``SingleTurnEnv`` whose rubric raises on some rows and 3 steps on the ``ToolEnv``.
"""

from __future__ import annotations

import asyncio
import json
import os

import _verifiers_envs as envs
import pytest
import torch
from _local_engine import local_engine

from areal.experimental.openai import ArealOpenAI
from areal.experimental.openai.proxy import OpenAIProxyWorkflow, ProxyServer
from areal.infra import workflow_context
from areal.utils import stats_tracker
from areal.workflow.grouped import GroupedRolloutWorkflow, interactions_to_tensor_dict
from areal.workflow.verifiers import VerifiersAgent, environment_datasets, load_environment

pytestmark = pytest.mark.timeout(300)

ADMIN = "verifiers-test-admin"
SINGLE = "_verifiers_envs:load_single_turn"
TOOL = "_verifiers_envs:load_tool_env"
SAMPLING = {"temperature": 1.0, "max_tokens": 40}


def _proxy(path: str):
    from areal.utils.hf_utils import load_hf_tokenizer

    class _Ctx:
        def __enter__(self):
            self._eng_cm = local_engine(path, setup_timeout=300.0)
            eng = self._eng_cm.__enter__()
            client = ArealOpenAI(eng, load_hf_tokenizer(path), engine_max_tokens=1024)
            self._srv_cm = ProxyServer(client, admin_api_key=ADMIN)
            return self._srv_cm.__enter__()

        def __exit__(self, *exc):
            try:
                self._srv_cm.__exit__(*exc)
            finally:
                self._eng_cm.__exit__(*exc)

    return _Ctx()


@pytest.fixture(scope="module")
def base_proxy():
    from areal.models import get_tiny_base_path

    with _proxy(get_tiny_base_path()) as srv:
        yield srv


@pytest.fixture(scope="module")
def tool_proxy():
    from areal.models import tiny_tool

    with _proxy(tiny_tool.get_tiny_tool_path()) as srv:
        yield srv


class Recorded:
    """The agent under test, recording the reward each ``run`` returned (or its error) by
    its episode's position in the group (the episodes run concurrently and finish in any
    order)."""

    def __init__(self, agent):
        self.agent = agent
        self.by_index: dict[int, object] = {}

    @property
    def returned(self) -> list:
        return [self.by_index[i] for i in sorted(self.by_index)]

    async def run(self, data, **kw):
        index = workflow_context.get().sample_index
        try:
            out = await self.agent.run(data, **kw)
        except Exception as e:
            self.by_index[index] = e
            raise
        self.by_index[index] = out
        return out


def run_group(proxy, agent, data, n):
    recorded = Recorded(agent)
    wf = OpenAIProxyWorkflow(
        mode="inline", agent=recorded, proxy_addr=proxy.base_url, admin_api_key=ADMIN
    )
    out = asyncio.run(GroupedRolloutWorkflow(wf, n).arun_episode(None, dict(data)))
    return out, recorded.returned


def assert_rows_are_the_calls(out, rewards):
    """One row per model call; each episode's calls carry the rubric's reward; log-probs
    finite."""
    batch = interactions_to_tensor_dict(out)
    by_episode: dict[int, list] = {}
    for cid, it in out.items():
        by_episode.setdefault(out.episode_of[cid], []).append(it)
    assert sorted(by_episode) == list(range(len(rewards)))
    calls = sorted(v["calls"] for v in envs.SCORED.values())
    assert sorted(len(v) for v in by_episode.values()) == calls
    assert batch["input_ids"].shape[0] == sum(calls)
    for i, its in by_episode.items():
        assert its[-1].reward == pytest.approx(rewards[i])  # the last call: the episode's
    lm = batch["loss_mask"].bool()
    assert (lm.sum(1) >= 1).all()
    lp = batch["logprobs"]
    assert torch.isfinite(lp).all() and (lp[lm] <= 0).all() and (lp[lm] < 0).any()
    return batch


def test_environment_loaded_once_datasets_are_its_own():
    a = load_environment(SINGLE, {"n": 12})
    assert load_environment(SINGLE, {"n": 12}) is a
    assert load_environment(SINGLE, {"n": 13}) is not a
    train, evals = environment_datasets(SINGLE, {"n": 12})
    assert len(train) == 12 and len(evals) == 8
    assert train[0]["messages"] == train[0]["prompt"]
    assert train[0]["messages"][-1]["content"] == a.dataset[0]["question"]
    assert {r["answer"] for r in train} == set(a.dataset["answer"])
    with pytest.raises(ValueError, match="env="):
        VerifiersAgent(env="")
    with pytest.raises(ValueError, match="Could not import .no-such-environment-xyz."):
        load_environment("no-such-environment-xyz")


def test_single_turn_env_rows_are_calls_rewards_are_the_rubrics(base_proxy):
    envs.SCORED.clear()
    load_environment(SINGLE)
    train, _ = environment_datasets(SINGLE)
    agent = VerifiersAgent(env=SINGLE, sampling_args=SAMPLING)
    out, rewards = run_group(base_proxy, agent, train[0], n=3)
    assert all(isinstance(r, float) for r in rewards), rewards
    assert_rows_are_the_calls(out, rewards)
    # the rubric's weighted sum, recomputed from each rollout's own answer
    expected = []
    for v in envs.SCORED.values():
        completion = [{"role": "assistant", "content": v["text"]}]
        expected.append(
            envs.correct_answer(completion, v["answer"]) + 0.5 * envs.short_answer(completion)
        )
    assert sorted(rewards) == pytest.approx(sorted(expected), abs=1e-6)


def test_tool_env_runs_the_tool_loop_one_row_per_call(tool_proxy):
    envs.SCORED.clear()
    train, _ = environment_datasets(TOOL)
    agent = VerifiersAgent(env=TOOL, sampling_args={"temperature": 0.7, "max_tokens": 48})
    out, rewards = run_group(tool_proxy, agent, train[0], n=2)
    assert all(isinstance(r, float) for r in rewards), rewards
    assert_rows_are_the_calls(out, rewards)
    assert max(v["calls"] for v in envs.SCORED.values()) >= 2  # call, result, answer
    for v in envs.SCORED.values():
        completion = [{"role": "assistant", "content": v["text"]}]
        assert envs.states_answer(completion, v["answer"]) in rewards


def test_group_reward_function_scores_the_group_together(base_proxy):
    envs.SCORED.clear()
    train, _ = environment_datasets("_verifiers_envs:load_group_env")
    agent = VerifiersAgent(env="_verifiers_envs:load_group_env", group_size=3, **SAMPLING)
    out, rewards = run_group(base_proxy, agent, train[0], n=3)
    assert len(rewards) == 3
    # group_best gives 2.0 to the shortest answers of the group (at least one of them)
    assert any(r >= 2.0 for r in rewards), rewards
    scored = list(envs.SCORED.values())
    shortest = min(len(v["text"]) for v in scored)
    expected = [
        envs.correct_answer([{"role": "assistant", "content": v["text"]}], v["answer"])
        + 2.0 * (len(v["text"]) == shortest)
        for v in scored
    ]
    assert sorted(rewards) == sorted(expected)


def test_raising_rubric_is_counted_logged_scored_zero_episode_kept(base_proxy, caplog):
    env_id = "_verifiers_envs:load_single_turn"
    args = {"n": 16, "raise_on_odd": True}
    train, _ = environment_datasets(env_id, args)
    odd = next(r for r in train if int(r["answer"]) % 2)
    agent = VerifiersAgent(env=env_id, env_args=args, sampling_args=SAMPLING)
    stats_tracker.get("rollout")  # the default scope of an episode outside the executor
    out, rewards = run_group(base_proxy, agent, odd, n=2)
    assert out is not None and all(isinstance(r, float) for r in rewards)
    stats = stats_tracker.export_all()
    assert stats["rollout/verifiers_reward_fn_errors"] == 1.0, stats
    assert "the rubric raises on odd answers" in caplog.text


def test_environment_that_hangs_or_gives_no_reward_fails_its_episode(base_proxy):
    env = load_environment(SINGLE)
    train, _ = environment_datasets(SINGLE)

    class Hanging(VerifiersAgent):
        async def _episode(self, *a, **k):
            await asyncio.sleep(60)

    wf_agent = Hanging(env=SINGLE, timeout=0.5)
    with pytest.raises(TimeoutError, match="timeout=0.5"):
        run_group(base_proxy, wf_agent, train[0], n=1)
    orig = env.rubric.score_rollout

    async def no_reward(state):
        await orig(state)
        state["reward"] = None

    env.rubric.score_rollout = no_reward
    try:
        with pytest.raises(ValueError, match="returned no reward"):
            run_group(base_proxy, VerifiersAgent(env=SINGLE, **SAMPLING), train[0], n=1)
    finally:
        env.rubric.score_rollout = orig


def _stats(log_dir):
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train(tmp_path, model_path, env_id, env_args, *extra):
    from test_rl_trainer import _grpo_config

    from areal import PPOTrainer

    cfg = _grpo_config(
        model_path,
        str(tmp_path),
        "total_train_steps=3",
        "allocation_mode=local:d1+fsdp:d1",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=40",
        "rollout.max_head_offpolicyness=1",
        *extra,
    )
    train, _ = environment_datasets(env_id, env_args)
    agent = VerifiersAgent(
        env=env_id,
        env_args=env_args,
        group_size=cfg.gconfig.n_samples,
        temperature=cfg.gconfig.temperature,
        max_completion_tokens=cfg.gconfig.max_new_tokens,
    )
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        result = trainer.train(workflow=agent)
        assert trainer.proxy_addr.startswith("http://127.0.0.1:")
        assert trainer.rollout.get_version() == 3
    assert result["steps_done"] == 3
    rows = _stats(result["log_dir"])
    assert all(r["update_successful"] == 1.0 for r in rows)
    return rows


@pytest.mark.slow
def test_ppo_trainer_trains_a_single_turn_env_whose_rubric_raises_3_steps(tmp_path):
    from areal.models import get_tiny_base_path

    rows = _train(tmp_path, get_tiny_base_path(), SINGLE, {"n": 64, "raise_on_odd": True})
    assert [r["batch/n_seqs"] for r in rows] == [8, 8, 8]  # 4 rows x 2 samples, 1 call each
    errors = [r.get("rollout/verifiers_reward_fn_errors") for r in rows]
    assert any(e is not None and e > 0 for e in errors), errors
    assert all(r["rollout/agent_failed"] == 0.0 for r in rows)


@pytest.mark.slow
def test_ppo_trainer_trains_a_tool_env_3_steps(tmp_path):
    from areal.models import tiny_tool

    rows = _train(
        tmp_path,
        tiny_tool.get_tiny_tool_path(),
        TOOL,
        {"n": 64},
        "gconfig.temperature=0.7",
        "gconfig.max_new_tokens=48",
    )
    assert all(r["batch/n_seqs"] >= 8 for r in rows)  # 1-3 calls per episode
    assert any(r["batch/n_seqs"] > 8 for r in rows)  # the tool loop made more calls
