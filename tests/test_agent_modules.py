"""AReaL's agent modules (``areal.workflow.{openai,openai_agent,anthropic,langchain}``).

Real episodes: each agent, constructed as AReaL's configs construct it, runs through the
proxy (``OpenAIProxyWorkflow``, inline mode: ``base_url`` / ``api_key`` / ``http_client``
in ``extra_kwargs``) in front of a built-in inference server serving the shipped tiny
tool-calling checkpoint, grouped as the trainer groups it (``n_samples = 2``), and
exported one row per model call. One server and proxy for the whole module.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from _local_engine import local_engine

from areal.experimental.openai import ArealOpenAI
from areal.experimental.openai.proxy import OpenAIProxyWorkflow, ProxyServer
from areal.infra import workflow_context
from areal.workflow.grouped import GroupedRolloutWorkflow, interactions_to_tensor_dict
from areal.workflow.openai import math_tools

pytestmark = pytest.mark.timeout(300)

ADMIN = "agent-modules-test-admin"
N_SAMPLES = 2
QUESTION = (
    "Mia has 31 apples. She buys 45 more apples. Then she gives away 12 apples. "
    "How many apples does Mia have now?"
)
DATA = {"messages": [{"role": "user", "content": QUESTION}], "answer": "64"}
# AReaL's agent_workflow/train.py passes these (small limits for the tiny model)
WORKFLOW_KWARGS = dict(
    temperature=1.0, top_p=1.0, max_tokens=64, max_completion_tokens=40, max_turns=3
)


@pytest.fixture(scope="module")
def tool_proxy():
    from areal.models import tiny_tool
    from areal.utils.hf_utils import load_hf_tokenizer

    path = tiny_tool.get_tiny_tool_path()
    with local_engine(path) as eng:
        client = ArealOpenAI(eng, load_hf_tokenizer(path), engine_max_tokens=4096)
        with ProxyServer(client, admin_api_key=ADMIN) as srv:
            yield srv


@pytest.fixture
def chat_calls(tool_proxy, monkeypatch):
    """Every Chat Completions call the proxy's model client serves: its tool names."""
    completions = tool_proxy.state.client.chat.completions
    create = completions.create
    seen: list[list[str]] = []

    async def counting_create(*args, **kwargs):
        seen.append([t["function"]["name"] for t in kwargs.get("tools") or []])
        return await create(*args, **kwargs)

    monkeypatch.setattr(completions, "create", counting_create)
    return seen


class Recorded:
    """The agent under test, recording what each ``run`` returned by its episode's position
    in the group (the episodes run concurrently and finish in any order)."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.by_index: dict[int, Any] = {}

    @property
    def returned(self) -> list[Any]:
        return [self.by_index[i] for i in sorted(self.by_index)]

    async def run(self, data, **extra_kwargs):
        index = workflow_context.get().sample_index
        out = await self.agent.run(data, **extra_kwargs)
        self.by_index[index] = out
        return out


def run_group(proxy, agent, data=DATA, n=N_SAMPLES):
    """One group of ``n`` episodes as the trainer runs it: interactions and their rows."""
    recorded = Recorded(agent)
    wf = OpenAIProxyWorkflow(
        mode="inline", agent=recorded, proxy_addr=proxy.base_url, admin_api_key=ADMIN
    )
    out = asyncio.run(GroupedRolloutWorkflow(wf, n).arun_episode(None, dict(data)))
    assert out is not None, "every episode of the group was rejected"
    assert len(recorded.returned) == n
    return out, interactions_to_tensor_dict(out), recorded.returned


def assert_rows_trainable(batch, n_rows):
    assert batch["input_ids"].shape[0] == n_rows
    lm = batch["loss_mask"].bool()
    assert (lm.sum(1) >= 1).all()  # every call's output tokens are trained on
    lp = batch["logprobs"]
    assert torch.isfinite(lp).all() and (lp[lm] < 0).any() and (lp[lm] <= 0).all()
    assert sorted(set(batch["episode_ids"].tolist())) == list(range(N_SAMPLES))


def episode_rows(out):
    by_episode: dict[int, list] = {}
    for cid, it in out.items():
        by_episode.setdefault(out.episode_of[cid], []).append(it)
    return [by_episode[i] for i in sorted(by_episode)]


AGENT_CLASSES = [
    "areal.workflow.openai.math_agent.MathAgent",
    "areal.workflow.openai.math_agent.MultiTurnMathAgent",
    "areal.workflow.openai.math_agent.MathToolAgent",
    "areal.workflow.anthropic.math_agent.MathAgent",
    "areal.workflow.anthropic.claude_math_agent.MathToolAgent",
    "areal.workflow.langchain.math_agent.MathAgent",
    "areal.workflow.langchain.math_agent.MathToolAgent",
]


@pytest.mark.parametrize("path", AGENT_CLASSES)
def test_agent_is_an_agent_and_picklable_for_subproc_mode(path):
    import pickle

    from areal.experimental.openai.proxy import is_agent
    from areal.utils.dynamic_import import import_from_string

    agent = import_from_string(path)(**WORKFLOW_KWARGS)
    assert is_agent(agent)
    clone = pickle.loads(pickle.dumps(agent))  # subproc mode sends it to a worker
    assert type(clone) is type(agent) and clone.__dict__.keys() == agent.__dict__.keys()


# ----------------------------------------------------------------------------- openai
def test_openai_multi_turn_math_agent_asks_again_rows_per_call_rewards_by_id(
    tool_proxy, chat_calls
):
    from areal.workflow.openai.math_agent import MultiTurnMathAgent

    wrong = dict(DATA, answer="-123456.5")  # never right: every episode takes max_turns calls
    out, batch, returned = run_group(tool_proxy, MultiTurnMathAgent(**WORKFLOW_KWARGS), wrong)
    assert len(chat_calls) == N_SAMPLES * 3
    assert_rows_trainable(batch, len(chat_calls))
    for rewards, rows in zip(returned, episode_rows(out), strict=True):
        assert list(rewards.values()) == [0.0, 0.0, 0.0]
        assert [it.reward for it in rows] == [0.0, 0.0, 0.0]
    # each call's prompt holds the earlier turns and the retry message
    for rows in episode_rows(out):
        lens = [it.to_tensor_dict()["input_ids"].shape[1] for it in rows]
        assert lens == sorted(lens) and lens[0] < lens[-1]


def test_openai_math_agent_one_call_reward_is_the_agents(tool_proxy, chat_calls):
    from areal.utils.dynamic_import import import_from_string

    # as the trainer builds it from AReaL's config line and workflow kwargs
    agent_cls = import_from_string("areal.workflow.openai.math_agent.MathAgent")
    out, batch, returned = run_group(tool_proxy, agent_cls(**WORKFLOW_KWARGS))
    assert len(chat_calls) == N_SAMPLES and len(out) == N_SAMPLES
    assert_rows_trainable(batch, N_SAMPLES)
    assert [it.reward for (it,) in episode_rows(out)] == returned
    assert all(r in (0.0, 1.0) for r in returned)


def test_openai_math_tool_agent_runner_runs_the_calculator(tool_proxy, chat_calls):
    from areal.workflow.openai.math_agent import MathToolAgent

    before = sum(math_tools.TOOL_CALLS.values())
    # the tiny tool model was trained with no system prompt and the calculator alone
    kwargs = dict(WORKFLOW_KWARGS, temperature=0.0, instructions=None, tools=["calculator"])
    out, batch, returned = run_group(tool_proxy, MathToolAgent(**kwargs))
    ran = sum(math_tools.TOOL_CALLS.values()) - before
    assert ran >= N_SAMPLES  # the Runner executed the model's tool calls
    assert len(chat_calls) == len(out) >= 2 * N_SAMPLES  # a call turn and an answer turn each
    assert all(names == ["calculator"] for names in chat_calls)
    assert_rows_trainable(batch, len(out))
    assert [rows[-1].reward for rows in episode_rows(out)] == returned
    assert returned == [1.0] * N_SAMPLES  # greedy tiny-tool: 31 + 45 - 12 = 64


# ----------------------------------------------------------------------------- openai_agent
HANDOFFS = ["analyze_problem", "solve_problem", "refine_solution", "verify_solution"]


class HandoffAgentChat:
    """AReaL's ``examples/openai_agents`` episode through the proxy: build the agent,
    ``Runner.run`` it on the proxy's client, then once more with a follow-up question on
    the first run's transcript (two turns of a chat); the reward of the final output."""

    def __init__(self, **builder_kwargs):
        self.builder_kwargs = builder_kwargs

    async def run(self, data, **extra_kwargs):
        import agents

        from areal.workflow.openai.math_agent import openai_client
        from areal.workflow.openai_agent.math_agent import build_math_agent

        run_config = agents.RunConfig(
            model_provider=agents.OpenAIProvider(
                openai_client=openai_client(extra_kwargs), use_responses=False
            ),
            tracing_disabled=True,
            model_settings=agents.ModelSettings(temperature=0.0, max_tokens=24),
        )
        agent = build_math_agent(**self.builder_kwargs)
        first = await agents.Runner.run(
            agent, input=data["messages"][-1]["content"], run_config=run_config, max_turns=2
        )
        follow_up = first.to_input_list() + [{"role": "user", "content": "Are you sure?"}]
        second = await agents.Runner.run(
            first.last_agent, input=follow_up, run_config=run_config, max_turns=2
        )
        return math_tools.math_reward_fn(str(second.final_output), data["answer"])


def test_openai_agent_build_math_agent_has_aReaLs_handoffs():
    from areal.workflow.openai_agent.math_agent import build_math_agent

    agent = build_math_agent()
    assert agent.name == "Math Problem Solver" and agent.tools == []
    assert [h.tool_name for h in agent.handoffs] == HANDOFFS
    assert "multi-agent system" in agent.instructions  # the SDK's handoff prompt prefix
    tooled = build_math_agent(tools=["calculator"], instructions=False)
    assert [t.name for t in tooled.tools] == ["calculator"] and tooled.instructions is None
    with pytest.raises(ValueError, match="allowed"):
        build_math_agent(tools=["abacus"])


def test_openai_agent_build_math_agent_without_handoffs_is_the_plain_tool_agent():
    """``handoffs=False`` (an ``agent_builder_kwargs`` override of AReaL's openai_agents
    YAML): the calculator agent the tiny tool model was trained as, no specialists."""
    from areal.workflow.openai_agent.math_agent import build_math_agent

    plain = build_math_agent(tools=["calculator"], instructions=False, handoffs=False)
    assert plain.handoffs == [] and [t.name for t in plain.tools] == ["calculator"]
    assert plain.instructions is None


def test_openai_agent_handoff_agent_chat_through_proxy_row_per_call(tool_proxy, chat_calls):
    from areal.models.tiny_tool import get_tiny_tool_path
    from areal.utils.hf_utils import load_hf_tokenizer

    out, batch, returned = run_group(tool_proxy, HandoffAgentChat())
    # every call offers the four handoffs; each episode made two calls (one per run)
    assert chat_calls == [HANDOFFS] * (2 * N_SAMPLES)
    assert len(out) == 2 * N_SAMPLES
    assert_rows_trainable(batch, len(out))
    for rows, reward in zip(episode_rows(out), returned, strict=True):
        assert len(rows) == 2 and rows[-1].reward == reward
        first, second = (it.to_tensor_dict()["input_ids"][0] for it in rows)
        assert second.shape[0] > first.shape[0]  # the second run saw the first's transcript
    prompt = load_hf_tokenizer(get_tiny_tool_path()).decode(second.tolist())
    assert "multi-agent system" in prompt and "Are you sure?" in prompt


# ----------------------------------------------------------------------------- anthropic
@pytest.fixture
def messages_calls(monkeypatch):
    """The replies the proxy's ``/v1/messages`` route translated back to Anthropic."""
    from areal.experimental.openai.proxy import anthropic_format

    to_anthropic = anthropic_format.openai_to_anthropic
    seen: list[dict] = []

    def recording(completion, model):
        seen.append(to_anthropic(completion, model))
        return seen[-1]

    monkeypatch.setattr(anthropic_format, "openai_to_anthropic", recording)
    return seen


def test_anthropic_math_agent_goes_through_v1_messages(tool_proxy, chat_calls, messages_calls):
    from areal.workflow.anthropic import MathAgent

    data = dict(DATA, messages=[{"role": "system", "content": "Be brief."}, *DATA["messages"]])
    out, batch, returned = run_group(tool_proxy, MathAgent(**WORKFLOW_KWARGS), data)
    assert len(messages_calls) == len(chat_calls) == len(out) == N_SAMPLES
    # the Anthropic message id is the exported interaction's id
    assert sorted(m["id"] for m in messages_calls) == sorted(out)
    assert_rows_trainable(batch, N_SAMPLES)
    assert [it.reward for (it,) in episode_rows(out)] == returned


def test_anthropic_math_tool_agent_tool_use_loop_runs_the_calculator(
    tool_proxy, chat_calls, messages_calls
):
    from areal.workflow.anthropic.claude_math_agent import MathToolAgent

    before = math_tools.TOOL_CALLS["calculator"]
    agent = MathToolAgent(
        system_prompt=None, tools=["calculator"], **dict(WORKFLOW_KWARGS, temperature=0.0)
    )
    out, batch, returned = run_group(tool_proxy, agent)
    assert math_tools.TOOL_CALLS["calculator"] - before == N_SAMPLES
    assert [m["stop_reason"] for m in messages_calls].count("tool_use") == N_SAMPLES
    assert len(messages_calls) == len(chat_calls) == len(out) == 2 * N_SAMPLES
    assert all(names == ["calculator"] for names in chat_calls)
    assert_rows_trainable(batch, len(out))
    assert [rows[-1].reward for rows in episode_rows(out)] == returned == [1.0] * N_SAMPLES
    with pytest.raises(ValueError, match="allowed"):
        MathToolAgent(tools=["abacus"])


# ----------------------------------------------------------------------------- langchain
def test_langchain_math_agent_chat_model_on_the_proxy(tool_proxy, chat_calls):
    from areal.workflow.langchain import MathAgent

    out, batch, returned = run_group(tool_proxy, MathAgent(**WORKFLOW_KWARGS))
    assert len(chat_calls) == len(out) == N_SAMPLES
    assert_rows_trainable(batch, N_SAMPLES)
    assert [it.reward for (it,) in episode_rows(out)] == returned


def test_langchain_math_tool_agent_create_agent_runs_the_calculator(tool_proxy, chat_calls):
    from areal.workflow.langchain.math_agent import MathToolAgent

    before = math_tools.TOOL_CALLS["calculator"]
    agent = MathToolAgent(
        system_prompt=None, tools=["calculator"], **dict(WORKFLOW_KWARGS, temperature=0.0)
    )
    out, batch, returned = run_group(tool_proxy, agent)
    assert math_tools.TOOL_CALLS["calculator"] - before == N_SAMPLES
    assert len(chat_calls) == len(out) == 2 * N_SAMPLES  # a call turn and an answer turn
    assert all(names == ["calculator"] for names in chat_calls)
    assert_rows_trainable(batch, len(out))
    assert [rows[-1].reward for rows in episode_rows(out)] == returned == [1.0] * N_SAMPLES
