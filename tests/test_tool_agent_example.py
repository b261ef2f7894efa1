"""``examples/agent_workflow/tool_agent.py``: the openai-agents calculator agent's episode.

Real pieces: the built-in inference server serving the shipped tiny tool-calling
checkpoint, the proxy on 127.0.0.1, the ``openai-agents`` Runner executing the model's own
tool calls. The training run itself is the demo (minutes), not a test.
"""

import asyncio
import importlib.util
import os

import pytest
from _local_engine import local_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


ADMIN = "tool-agent-test-admin"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    path = os.path.join(ROOT, "examples", "agent_workflow", "tool_agent.py")
    spec = importlib.util.spec_from_file_location("tool_agent_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool_proxy():
    from areal.experimental.openai import ArealOpenAI
    from areal.experimental.openai.proxy import ProxyServer
    from areal.models import tiny_tool
    from areal.utils.hf_utils import load_hf_tokenizer

    path = tiny_tool.get_tiny_tool_path()
    with local_engine(path) as eng:
        client = ArealOpenAI(eng, load_hf_tokenizer(path), engine_max_tokens=512)
        with ProxyServer(client, admin_api_key=ADMIN) as srv:
            yield srv


def test_tool_agent_episode_greedy_records_match_reward_and_calls(tool_proxy):
    from areal.dataset.synthetic import ArithSpec, generate_arith_problems
    from areal.experimental.openai.proxy import OpenAIProxyWorkflow

    mod = _example()
    agent = mod.ToolAgent(max_tokens=48, temperature=0.0, record=True)
    wf = OpenAIProxyWorkflow(
        mode="inline", agent=agent, proxy_addr=tool_proxy.base_url, admin_api_key=ADMIN
    )
    spec = ArithSpec(digits=2, steps=2, ops=("add", "sub"), n=2, seed=0)
    rows = generate_arith_problems(spec, split="test")
    for row in rows:
        data = {"messages": [{"role": "user", "content": row["question"]}], "answer": row["answer"]}
        assert mod.true_result(row["answer"]) == row["result"]
        out = asyncio.run(wf.arun_episode(None, data))
        rec = agent.records[-1]
        # greedy tiny-tool always calls the calculator first (its README: 100% valid calls)
        assert rec["tool_called"]
        assert len(out) == 2  # the call turn and the answer turn, both recorded
        last = list(out.values())[-1]
        assert last.reward == float(rec["answer_correct"])
        assert rec["success"] == (rec["expression_correct"] and rec["answer_correct"])
    summary = mod.summarize(agent.records)
    assert summary["n"] == 2 and summary["tool_called"] == 1.0
