"""The necessary-tool task (examples/tool_task): data, tool, reward, base model, rows.

- the one-operation calculator and the reward: a wrong direct guess scores 0, the answer
  the two calls give scores 1;
- real episodes of :class:`ToolArithAgent` through the proxy and a built-in server
  serving the shipped base ``tiny-tool-mix`` (one server and proxy for the module): with
  the tool disabled the base solves no held-out problem (greedy); with it, it solves
  some; one training row per model call, the tool results in the next row's prompt and
  never in its loss mask, every row of an episode carrying the episode's reward.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
from pathlib import Path

import pytest
from _local_engine import local_engine

from areal.dataset.tool_arith import generate_tool_arith_problems, tool_arith_dataset, transcript
from areal.models.tiny_tool import get_tiny_tool_mix_path
from areal.reward.tool_arith import step_calculator, tool_arith_reward_fn

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
ADMIN = "tool-task-test-admin"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


AGENT = _load("tool_task_agent", ROOT / "examples/tool_task/agent.py")


def _data(row: dict) -> dict:
    return {"messages": [{"role": "user", "content": row["question"]}], "answer": row["answer"]}


def test_problems_are_seeded_and_held_out_is_disjoint():
    a = generate_tool_arith_problems(50, seed=3, split="train")
    assert a == generate_tool_arith_problems(50, seed=3, split="train")
    test = generate_tool_arith_problems(100, seed=3, split="test")
    train_ops = {r["operands"] for r in generate_tool_arith_problems(20_000, 3, "train")}
    assert not any(r["operands"] in train_ops for r in test)
    x, y, z = a[0]["operands"]
    assert a[0]["result"] == x * y + z and a[0]["answer"].endswith(f"#### {x * y + z}")
    ds = tool_arith_dataset("tool_arith://?n=4&seed=3", "test")
    assert len(ds) == 4 and ds[0]["messages"][0]["content"] == test[0]["question"]


def test_calculator_and_reward():
    assert step_calculator("47 * 86") == "4042" and step_calculator("4042 + 315") == "4357"
    assert step_calculator("47 * 86 + 315").startswith("error")  # one operation at a time
    assert step_calculator("__import__('os')").startswith("error")
    row = generate_tool_arith_problems(1, seed=0, split="test")[0]
    rng = random.Random(0)
    guess = transcript(row, "direct", rng)[-1]["content"]
    assert tool_arith_reward_fn(guess, row["answer"]) == 0.0
    msgs = transcript(row, "tool", rng)
    calls = [m["tool_calls"][0]["function"]["arguments"]["expression"] for m in msgs[1::2][:2]]
    assert calls[1].startswith(step_calculator(calls[0]) + " ")  # uses the first result
    assert tool_arith_reward_fn(f"The answer is {step_calculator(calls[1])}.", row["answer"]) == 1
    assert tool_arith_reward_fn("no number", row["answer"]) == 0.0


@pytest.fixture(scope="module")
def proxy():
    from areal.experimental.openai import ArealOpenAI
    from areal.experimental.openai.proxy import ProxyServer
    from areal.utils.hf_utils import load_hf_tokenizer

    path = get_tiny_tool_mix_path()
    tok = load_hf_tokenizer(path)
    with local_engine(path) as eng:
        client = ArealOpenAI(eng, tok, engine_max_tokens=4096, tool_call_parser="qwen")
        with ProxyServer(client, admin_api_key=ADMIN) as srv:
            yield srv, tok


def _episodes(srv, agent, rows, group: int = 1):
    from areal.experimental.openai.proxy import OpenAIProxyWorkflow
    from areal.workflow.grouped import GroupedRolloutWorkflow

    wf = OpenAIProxyWorkflow(
        mode="inline", agent=agent, proxy_addr=srv.base_url, admin_api_key=ADMIN
    )

    async def all_rows():
        g = GroupedRolloutWorkflow(wf, group)
        return await asyncio.gather(*(g.arun_episode(None, _data(r)) for r in rows))

    return asyncio.run(all_rows())


def test_base_needs_the_tool(proxy):
    srv, _ = proxy
    rows = generate_tool_arith_problems(32, seed=0, split="test")
    without = AGENT.ToolArithAgent(temperature=0.0, record=True, use_tool=False)
    with_tool = AGENT.ToolArithAgent(temperature=0.0, record=True)
    _episodes(srv, without, rows)
    _episodes(srv, with_tool, rows)
    off, on = AGENT.summarize(without.records), AGENT.summarize(with_tool.records)
    assert off["n"] == on["n"] == 32
    assert off["success"] == 0.0  # direct guesses are wrong
    assert 0.0 < on["tool_called"] < 1.0  # greedy calls on some templates only
    assert on["success"] >= 0.1 and on["model_calls"] > 1.2


def test_agent_rows_one_per_call_tool_results_masked(proxy):
    from areal.workflow.grouped import interactions_to_tensor_dict

    srv, tok = proxy
    # template 0 names the calculator: the base calls it there
    row = next(r for r in generate_tool_arith_problems(64, 0, "test") if r["template"] == 0)
    agent = AGENT.ToolArithAgent(max_tokens=32, temperature=1.0, record=True)
    (out,) = _episodes(srv, agent, [row], group=4)
    assert out is not None
    batch = interactions_to_tensor_dict(out)
    calls = [r["model_calls"] for r in agent.records]
    assert batch["input_ids"].shape[0] == sum(calls)  # one row per model call
    assert max(calls) >= 2  # some episode called the tool and then the model again
    per_ep: dict[int, list[int]] = {}
    for i, ep in enumerate(batch["episode_ids"].tolist()):
        per_ep.setdefault(ep, []).append(i)
    assert len(per_ep) == 4
    for rows in per_ep.values():  # the episode's reward on every call
        assert len({float(batch["rewards"][i]) for i in rows}) == 1
    later_calls = 0
    for i in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        lm = batch["loss_mask"][i][: ids.shape[0]].bool()
        assert lm.any()
        trained, prompt = tok.decode(ids[lm].tolist()), tok.decode(ids[~lm].tolist())
        assert "<|im_start|>tool" not in trained and "<|im_start|>user" not in trained
        later_calls += "<|im_start|>tool" in prompt  # the tool's result: context only
    assert later_calls >= 1
