"""OpenEnv servers as multi-turn workflows (``areal.workflow.openenv``).

The server (``tests/_openenv_server.py``) is written with openenv's public API
(``Environment``, ``Action``, ``Observation``, ``create_fastapi_app``) and started by the
agent itself (``app="_openenv_server:app"``: uvicorn on 127.0.0.1). Episodes run through
the real proxy in front of a built-in server with the tiny model; then ``PPOTrainer``
trains 3 steps on it.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from _local_engine import local_engine

from areal.experimental.openai import ArealOpenAI
from areal.experimental.openai.proxy import OpenAIProxyWorkflow, ProxyServer
from areal.workflow.grouped import GroupedRolloutWorkflow, interactions_to_tensor_dict
from areal.workflow.openenv import OpenEnvAgent, openenv_rows, start_server

pytestmark = pytest.mark.timeout(600)

ADMIN = "openenv-test-admin"
APP = "_openenv_server:app"


@pytest.fixture(scope="module")
def proxy():
    from areal.models import get_tiny_base_path
    from areal.utils.hf_utils import load_hf_tokenizer

    path = get_tiny_base_path()
    with local_engine(path, setup_timeout=300.0) as eng:
        client = ArealOpenAI(eng, load_hf_tokenizer(path), engine_max_tokens=1024)
        with ProxyServer(client, admin_api_key=ADMIN) as srv:
            yield srv


class Recorded:
    def __init__(self, agent):
        self.agent = agent
        self.returned: list = []

    async def run(self, data, **kw):
        out = await self.agent.run(data, **kw)
        self.returned.append(out)
        return out


def run_group(proxy, agent, data, n):
    recorded = Recorded(agent)
    wf = OpenAIProxyWorkflow(
        mode="inline", agent=recorded, proxy_addr=proxy.base_url, admin_api_key=ADMIN
    )
    out = asyncio.run(GroupedRolloutWorkflow(wf, n).arun_episode(None, dict(data)))
    return out, recorded.returned


def test_agent_arguments_are_checked():
    with pytest.raises(ValueError, match="exactly one of base_url"):
        OpenEnvAgent()
    with pytest.raises(ValueError, match="exactly one of base_url"):
        OpenEnvAgent(base_url="http://x", app=APP)
    with pytest.raises(ValueError, match="reward_mode"):
        OpenEnvAgent(app=APP, reward_mode="sum")
    assert openenv_rows(2, seed=5) == [{"reset": {"seed": 5}}, {"reset": {"seed": 6}}]


def test_episodes_reset_step_one_row_per_call_step_rewards(proxy):
    agent = OpenEnvAgent(app=APP, max_turns=2, temperature=1.0, max_completion_tokens=40)
    assert start_server(APP) == start_server(APP)  # started once per process
    out, returned = run_group(proxy, agent, {"reset": {"seed": 3}}, n=3)
    assert out is not None and len(returned) == 3
    batch = interactions_to_tensor_dict(out)
    n_calls = sum(len(r) for r in returned)  # per_step: {call id: step reward}
    assert batch["input_ids"].shape[0] == n_calls
    rewards = {cid: r for ep in returned for cid, r in ep.items()}
    assert {cid: it.reward for cid, it in out.items()} == rewards
    for ep in returned:
        # a wrong answer is followed by the second try (the observation as next turn)
        values = list(ep.values())
        assert 1 <= len(values) <= 2 and all(v in (0.0, 1.0) for v in values)
        assert len(values) == 2 or values[0] == 1.0
    lm = batch["loss_mask"].bool()
    assert torch.isfinite(batch["logprobs"]).all() and (batch["logprobs"][lm] <= 0).all()
    # the second call's prompt holds the server's "Wrong, try again" observation
    second = [it for it in out.values() if len(it.messages) > 1]
    assert all("Wrong, try again" in it.messages[-1]["content"] for it in second)


def test_final_mode_sums_step_rewards_onto_the_last_call(proxy):
    agent = OpenEnvAgent(app=APP, reward_mode="final", max_turns=2, max_completion_tokens=40)
    out, returned = run_group(proxy, agent, {"reset": {"seed": 4}}, n=2)
    assert all(isinstance(r, float) and r in (0.0, 1.0) for r in returned)


def test_dead_server_fails_the_episode_counted_not_a_hang(proxy):
    agent = OpenEnvAgent(base_url="http://127.0.0.1:9", timeout=60)
    with pytest.raises(OSError):
        run_group(proxy, agent, {"reset": {"seed": 1}}, n=1)


@pytest.mark.slow
def test_ppo_trainer_trains_on_an_openenv_server_3_steps(tmp_path):
    from test_rl_trainer import _grpo_config

    from areal import PPOTrainer
    from areal.models import get_tiny_base_path

    cfg = _grpo_config(
        get_tiny_base_path(),
        str(tmp_path),
        "total_train_steps=3",
        "allocation_mode=local:d1+fsdp:d1",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=40",
        "rollout.max_head_offpolicyness=1",
        "rollout.setup_timeout=300",
    )
    agent = OpenEnvAgent(app=APP, max_turns=2, max_completion_tokens=40)
    with PPOTrainer(cfg, train_dataset=openenv_rows(64)) as trainer:
        result = trainer.train(workflow=agent)
        assert trainer.rollout.get_version() == 3
    assert result["steps_done"] == 3
    with open(os.path.join(result["log_dir"], "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert all(r["update_successful"] == 1.0 for r in rows)
    assert all(8 <= r["batch/n_seqs"] <= 16 for r in rows)  # 4 rows x 2 episodes x 1-2 calls
    assert all(r["rollout/agent_failed"] == 0.0 for r in rows)
