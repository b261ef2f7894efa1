"""Agent programs (``async def run(data, **extra_kwargs)``) trained through the proxy.

Real pieces only: a built-in inference server with a tiny model, the proxy on
127.0.0.1, agents written against the official ``openai`` SDK (and ``openai-agents``),
and for the trainer test a real PPOTrainer with its workers.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from _local_engine import local_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

from areal.experimental.openai import ArealOpenAI  # noqa: E402
from areal.experimental.openai.proxy import OpenAIProxyWorkflow, ProxyServer  # noqa: E402

ADMIN = "agent-test-admin"
DATA = {
    "messages": [{"role": "user", "content": "Tom has 3 pens. He buys 4 more. How many?"}],
    "answer": "#### 7",
}


class TwoTurnAgent:
    """Asks, asks again, returns a float reward (AReaL's agent contract)."""

    def __init__(self, reward: float = 1.0, by_id: bool = False, crash_after_first: bool = False):
        self.reward = reward
        self.by_id = by_id
        self.crash_after_first = crash_after_first

    async def run(self, data, **extra_kwargs):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=extra_kwargs.get("base_url"),
            api_key=extra_kwargs.get("api_key"),
            http_client=extra_kwargs.get("http_client"),
        )
        messages = list(data["messages"])
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        if self.crash_after_first:
            raise RuntimeError("agent crashed mid-session")
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Are you sure?"},
        ]
        second = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        if self.by_id:
            return {first.id: 0.25, second.id: self.reward}
        return self.reward


class EnvAgent:
    """A subproc-mode agent: reads OPENAI_BASE_URL / OPENAI_API_KEY from the environment."""

    async def run(self, data):
        from openai import AsyncOpenAI

        async with AsyncOpenAI() as client:  # base URL and key from the environment
            await client.chat.completions.create(model="m", messages=data["messages"], max_tokens=5)
        return float(os.getpid() != int(data["parent_pid"]))  # 1.0: it ran in another process


@pytest.fixture(scope="module")
def proxy(tiny_lm_dir):
    from areal.utils.hf_utils import load_hf_tokenizer

    with local_engine(tiny_lm_dir) as eng:
        client = ArealOpenAI(eng, load_hf_tokenizer(tiny_lm_dir), engine_max_tokens=256)
        with ProxyServer(client, admin_api_key=ADMIN) as srv:
            yield srv


def _workflow(proxy, agent, mode="inline", discount=1.0):
    return OpenAIProxyWorkflow(
        mode=mode, agent=agent, proxy_addr=proxy.base_url, admin_api_key=ADMIN, discount=discount
    )


def test_inline_agent_float_reward_goes_to_last_call_with_discount(proxy):
    out = asyncio.run(_workflow(proxy, TwoTurnAgent(1.0), discount=0.5).arun_episode(None, DATA))
    assert len(out) == 2
    first, second = out.values()
    assert (first.reward, second.reward) == (0.5, 1.0)
    row = second.to_tensor_dict()
    # trained tokens carry the policy version that sampled them, the others -1
    lm, versions = row["loss_mask"][0].bool(), row["versions"][0]
    assert lm.sum() >= 1
    assert (versions[lm] == proxy.state.client.engine.get_version()).all(), versions
    assert (versions[~lm] == -1).all(), versions
    assert len(proxy.state.sessions) == 0  # exported sessions are forgotten


class ClosingAgent(TwoTurnAgent):
    """Records the ``http_client`` it was given and closes its OpenAI client after use."""

    def __init__(self):
        super().__init__(1.0)
        self.clients = []

    async def run(self, data, **extra_kwargs):
        from openai import AsyncOpenAI

        self.clients.append(extra_kwargs["http_client"])
        async with AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
        ) as client:
            await client.chat.completions.create(model="m", messages=data["messages"], max_tokens=4)
        return 1.0


def test_episodes_of_a_loop_share_one_client_closed_with_the_loop(proxy):
    agent = ClosingAgent()
    wf = _workflow(proxy, agent)

    async def three_episodes():
        # one after another: an agent closing "its" client must not break the next one
        return [await wf.arun_episode(None, DATA) for _ in range(3)]

    outs = asyncio.run(three_episodes())
    assert [len(o) for o in outs] == [1, 1, 1]
    assert len({id(c) for c in agent.clients}) == 1  # one keep-alive client per loop
    assert agent.clients[0].is_closed  # closed when asyncio.run shut the loop down
    # a new loop (the next evaluation's asyncio.run) gets a new, open client
    assert len(asyncio.run(wf.arun_episode(None, DATA))) == 1
    assert agent.clients[-1] is not agent.clients[0] and agent.clients[-1].is_closed


def test_inline_agent_dict_reward_sets_each_call(proxy):
    out = asyncio.run(_workflow(proxy, TwoTurnAgent(2.0, by_id=True)).arun_episode(None, DATA))
    # The export always propagates rewards backwards (discount 1.0 here): 0.25 + 2.0.
    assert [it.reward for it in out.values()] == [2.25, 2.0]


def test_agent_crash_mid_session_raises_and_discards_session(proxy):
    from areal.utils import stats_tracker

    stats_tracker.get("rollout").export()  # reset
    wf = _workflow(proxy, TwoTurnAgent(crash_after_first=True))
    with pytest.raises(RuntimeError, match="crashed mid-session"):
        asyncio.run(wf.arun_episode(None, DATA))
    assert len(proxy.state.sessions) == 0
    stats = stats_tracker.get("rollout").export()
    assert stats["rollout/agent_failed"] == 1.0


def test_agent_returning_wrong_type_is_rejected(proxy):
    class Bad:
        async def run(self, data, **kw):
            return "great"

    with pytest.raises(TypeError, match="expected a float"):
        asyncio.run(_workflow(proxy, Bad()).arun_episode(None, DATA))
    with pytest.raises(TypeError, match="async"):

        class Sync:
            def run(self, data, **kw):
                return 1.0

        _workflow(proxy, Sync())


def test_subproc_agent_runs_in_another_process_with_env_credentials(proxy):
    data = dict(DATA, parent_pid=str(os.getpid()))
    out = asyncio.run(_workflow(proxy, EnvAgent(), mode="subproc").arun_episode(None, data))
    (it,) = out.values()
    assert it.reward == 1.0


# ----------------------------------------------------------------------------- trainer
class CrashyMathAgent:
    """Answers with the OpenAI SDK; crashes mid-session on every third question."""

    def __init__(self, max_tokens: int = 12):
        self.max_tokens = max_tokens

    async def run(self, data, **extra_kwargs):
        from openai import AsyncOpenAI

        from areal.reward.gsm8k import gsm8k_reward_fn

        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
        )
        out = await client.chat.completions.create(
            model="m", messages=data["messages"], max_tokens=self.max_tokens
        )
        if len(data["messages"][0]["content"]) % 3 == 0:
            raise RuntimeError("agent crashed")
        return gsm8k_reward_fn(None, out.choices[0].message.content, None, None, data["answer"])


def test_ppo_trainer_trains_agent_through_proxy_crashes_counted_batch_completes(
    tiny_lm_dir, tmp_path
):
    from test_rl_trainer import _grpo_config, _rows

    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=2",
        "allocation_mode=local:d1+fsdp:d1",
        "gconfig.n_samples=2",
        "rollout.max_head_offpolicyness=1",
        "rollout.agent.turn_discount=0.9",
    )
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    crashy = sum(len(r["messages"][0]["content"]) % 3 == 0 for r in train)
    assert 0 < crashy < len(train)
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        result = trainer.train(workflow=CrashyMathAgent())
        assert trainer.proxy_addr.startswith("http://127.0.0.1:")
        rejected = trainer.rollout.workflow_executor.rejection_reasons
        assert trainer.rollout.get_version() == 2
    assert result["steps_done"] == 2
    assert rejected.get("error", 0) >= 1, rejected
    rows = _rows(result["log_dir"])
    assert [r["batch/n_seqs"] for r in rows] == [8, 8]  # 4 groups x 2 samples, one call each
    assert all(r["staleness/max"] <= 1 for r in rows)
    failed = [r.get("rollout/agent_failed") for r in rows]
    assert any(f is not None and f > 0 for f in failed), failed
    assert all(r["update_successful"] == 1.0 for r in rows)


class VariableCallsAgent:
    """1-3 calls per episode (one row each with ``individual`` export; groups get 7, 8 or
    9 rows); questions of even length get the same reward in every episode (a uniform
    group), the others ``sample_index / 3``. Records what it did per task."""

    def __init__(self):
        self.episodes: dict[int, dict[int, tuple[int, float]]] = {}  # task -> member -> ...

    async def run(self, data, **extra_kwargs):
        from openai import AsyncOpenAI

        from areal.infra import workflow_context

        ctx = workflow_context.get()
        question = data["messages"][0]["content"]
        uniform = len(question) % 2 == 0
        i = ctx.sample_index
        n_calls = 1 + (i + len(question)) % 3
        reward = 1.0 if uniform else i / 3
        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
        )
        messages = list(data["messages"])
        for _ in range(n_calls):
            out = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [
                out.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Again?"},
            ]
        self.episodes.setdefault(ctx.task_id, {})[i] = (n_calls, reward)
        return reward


def test_ppo_trainer_individual_export_variable_calls_groups_by_episode(tiny_lm_dir, tmp_path):
    """The 'Batch size not a multiple of group_size' bug: n_samples=4 agent episodes of 1-3
    calls each, exported one row per call, through a real training step on two ranks."""
    import statistics

    from test_rl_trainer import _grpo_config

    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=1",
        "allocation_mode=local:d1+fsdp:d2",
        "async_training=false",
        "actor.dynamic_sampling=true",
        "rollout.agent.export_style=individual",
        "gconfig.max_new_tokens=4",
    )
    assert cfg.gconfig.n_samples == 4 and cfg.actor.reward_norm.mean_level == "group"
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    agent = VariableCallsAgent()
    seen = []
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        compute_advantages = trainer.actor.compute_advantages

        def spy(batch, *a, **kw):
            out = compute_advantages(batch, *a, **kw)
            seen.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
            return out

        trainer.actor.compute_advantages = spy
        result = trainer.train(workflow=agent)
        rejected = dict(trainer.rollout.workflow_executor.rejection_reasons)
    assert result["steps_done"] == 1 and len(seen) == 1
    batch = seen[0]
    uniform = {t for t, eps in agent.episodes.items() if len({r for _, r in eps.values()}) == 1}
    mixed = set(agent.episodes) - uniform
    # the filter dropped exactly the uniform groups; the batch holds exactly the others
    assert uniform and rejected.get("filtered", 0) == len(uniform), (rejected, uniform)
    gids, eids = batch["group_ids"].tolist(), batch["episode_ids"].tolist()
    assert set(gids) == mixed and len(mixed) == cfg.train_dataset.batch_size
    n_rows = sum(n for t in mixed for n, _ in agent.episodes[t].values())
    assert len(gids) == n_rows and n_rows % 4 != 0  # what used to fail the split
    m = batch["loss_mask"].bool()
    norm = cfg.actor.reward_norm
    for t in mixed:
        eps = agent.episodes[t]
        mean = statistics.mean(r for _, r in eps.values())
        std = statistics.stdev(r for _, r in eps.values())
        rows = [k for k, g in enumerate(gids) if g == t]
        episodes = sorted({eids[k] for k in rows})  # episode ids follow the member order
        for member, e in enumerate(episodes):
            n_calls, reward = eps[member]
            ep_rows = [k for k in rows if eids[k] == e]
            assert len(ep_rows) == n_calls
            want = (reward - mean) / (std + norm.eps)
            for k in ep_rows:  # every row (call) of the episode: the episode's advantage
                adv = batch["advantages"][k][m[k]]
                assert adv.numel() > 0 and torch.allclose(
                    adv, torch.full_like(adv, want), atol=1e-5
                )
        # normalised over the 4 episodes, not the 7-9 rows (whose mean differs)
        row_mean = statistics.mean(float(batch["rewards"][k]) for k in rows)
        assert abs(row_mean - mean) > 0.01
    assert torch.isfinite(batch["advantages"]).all()


# ----------------------------------------------------------------------------- tool calls
@pytest.fixture(scope="module")
def tool_proxy():
    """The proxy in front of a server serving the shipped tiny tool-calling checkpoint."""
    from areal.models import tiny_tool
    from areal.utils.hf_utils import load_hf_tokenizer

    path = tiny_tool.get_tiny_tool_path()
    with local_engine(path) as eng:
        client = ArealOpenAI(eng, load_hf_tokenizer(path), engine_max_tokens=512)
        with ProxyServer(client, admin_api_key=ADMIN) as srv:
            yield srv


TOOL_QUESTION = (
    "Mia has 31 apples. She buys 45 more apples. Then she gives away 12 apples. "
    "How many apples does Mia have now?"
)


class CalculatorAgent:
    """Plain OpenAI SDK: offer the calculator, run the model's call, read its answer."""

    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        from areal.models.tiny_tool import CALCULATOR_TOOL, run_calculator_call

        client = AsyncOpenAI(
            base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"]
        )
        messages = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(
            model="tiny-tool",
            messages=messages,
            tools=[CALCULATOR_TOOL],
            temperature=0,
            max_tokens=48,
        )
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls", msg
        (call,) = msg.tool_calls
        result = run_calculator_call(call.function.arguments)
        data["trace"] += [call.function.name, call.function.arguments, result]
        messages += [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]
        second = await client.chat.completions.create(
            model="tiny-tool",
            messages=messages,
            tools=[CALCULATOR_TOOL],
            temperature=0,
            max_tokens=24,
        )
        data["trace"].append(second.choices[0].message.content)
        return 1.0 if result in (second.choices[0].message.content or "") else 0.0


def test_tool_call_round_trip_with_the_tiny_tool_models_own_output(tool_proxy):
    data = {"question": TOOL_QUESTION, "trace": []}
    out = asyncio.run(_workflow(tool_proxy, CalculatorAgent()).arun_episode(None, data))
    name, arguments, result, final = data["trace"]
    assert name == "calculator"
    assert "expression" in json.loads(arguments)
    assert result.lstrip("-").isdigit()  # the model's expression evaluated
    assert final.startswith("The answer is")
    assert len(out) == 2
    first, second = out.values()
    # the second prompt holds the first call's output and the tool result
    assert (
        second.to_tensor_dict()["input_ids"].shape[1] > first.to_tensor_dict()["input_ids"].shape[1]
    )


def test_anthropic_sdk_tool_use_block_from_the_tiny_tool_model(tool_proxy):
    import anthropic

    from areal.models.tiny_tool import CALCULATOR_TOOL

    r = asyncio.run(_start_session(tool_proxy))
    client = anthropic.Anthropic(base_url=tool_proxy.base_url, api_key=r["api_key"])
    fn = CALCULATOR_TOOL["function"]
    msg = client.messages.create(
        model="tiny-tool",
        max_tokens=48,
        extra_body={"temperature": 0},  # this SDK version has no temperature argument
        tools=[
            {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
        ],
        messages=[{"role": "user", "content": TOOL_QUESTION}],
    )
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "calculator" and "expression" in block.input


async def _start_session(proxy):
    from areal.experimental.openai.proxy.client_session import import_httpx

    async with import_httpx().AsyncClient() as http:
        r = await http.post(
            f"{proxy.base_url}/rl/start_session",
            json={},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        return r.json()


def test_openai_agents_sdk_calls_the_function_tool_through_proxy(tool_proxy):
    import agents
    from openai import AsyncOpenAI

    from areal.models.tiny_tool import calculator as calc

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        calls.append(expression)
        return calc(expression)

    class SdkToolAgent:
        async def run(self, data, **kw):
            client = AsyncOpenAI(
                base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"]
            )
            agent = agents.Agent(
                name="calc",
                tools=[calculator],
                model=agents.OpenAIChatCompletionsModel(model="tiny-tool", openai_client=client),
                model_settings=agents.ModelSettings(max_tokens=48, temperature=0.0),
            )
            result = await agents.Runner.run(agent, data["question"], max_turns=3)
            data["final"] = result.final_output
            # rewarded for using the tool: 1.0 when the Runner ran it once
            return float(len(calls) == 1)

    data = {"question": TOOL_QUESTION}
    out = asyncio.run(_workflow(tool_proxy, SdkToolAgent()).arun_episode(None, data))
    assert len(calls) == 1 and calls[0]  # the model's own call ran the Python tool
    assert data["final"].startswith("The answer is")
    assert len(out) == 2  # the call turn and the answer turn, both recorded
    last = list(out.values())[-1]
    # the reward the agent computed from the tool call reaches the exported answer turn
    assert last.reward == 1.0 and last.to_tensor_dict()["loss_mask"].sum() >= 1


class TwoCallAgent:
    """Two model calls per episode through whatever proxy URL it is given; reward 1."""

    async def run(self, data, **extra_kwargs):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
        )
        messages = list(data["messages"])
        for _ in range(2):
            out = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [
                out.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Again?"},
            ]
        return float(len(data["messages"][0]["content"]) % 2)


def test_ppo_trainer_trains_through_the_gateway_with_two_proxy_workers(tiny_lm_dir, tmp_path):
    """``rollout.agent.proxy_workers=2``: the trainer's scheduler starts two proxy worker
    processes behind the session-affine gateway; two training steps run on what they
    export (two rows per episode), both workers carry sessions, none fails."""
    from test_rl_trainer import _grpo_config, _rows

    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.experimental.openai.proxy.gateway import GatewayServer
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=2",
        "allocation_mode=local:d1+fsdp:d1",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=4",
        "rollout.max_head_offpolicyness=1",
        "rollout.agent.proxy_workers=2",
        "rollout.agent.export_style=individual",
    )
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        result = trainer.train(workflow=TwoCallAgent())
        gateway = trainer._agents.server
        assert isinstance(gateway, GatewayServer)
        stats = gateway.stats()
    assert result["steps_done"] == 2
    rows = _rows(result["log_dir"])
    # 4 groups x 2 episodes x 2 calls, one row per call
    assert [r["batch/n_seqs"] for r in rows] == [16, 16]
    per_worker = [w["sessions_total"] for w in stats["workers"]]
    assert len(per_worker) == 2 and min(per_worker) > 0, per_worker
    assert sum(per_worker) >= 16  # every trained episode was a gateway session
    assert stats["sessions_failed"] == 0 and stats["requests_failed"] == 0
