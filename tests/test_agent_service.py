"""The agent service (areal.v2.agent_service): AReaL 2.0's gateway + agent workers.

Real processes on loopback: ``AgentController`` over a ``LocalScheduler`` starts the
gateway and the workers running ``examples/agent_service/chat_agent.py``; turns go
through ``POST /v1/responses`` as 2.0's clients send them. The slow test trains 3 online
PPO steps on sessions whose model calls the agent made through the trainer's proxy
(the client passes ``inf_base_url`` / ``session_api_key``, as 2.0's hermes_loop.py).
The agent's training mode (the operator's variables, the agent does the bookkeeping) is
trained with 2.0's own client in tests/test_agent_service_areal.py; here: its reward
rule and its configuration errors.
"""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from areal.api.cli_args import AgentConfig
from areal.infra.scheduler.local import LocalScheduler
from areal.v2.agent_service.controller import AgentController

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
AGENT = "examples.agent_service.chat_agent.SessionChatAgent"
KEY = "agent-svc-test-key"
H = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.timeout(300)


def _turn(gw: str, user: str, text: str, key: str = KEY, **extra) -> httpx.Response:
    body = {"input": [{"type": "message", "content": text}], "model": "m", "user": user, **extra}
    return httpx.post(
        f"{gw}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def _text(r: httpx.Response) -> str:
    data = r.json()
    assert r.status_code == 200 and data["status"] == "completed", r.text
    [msg] = [i for i in data["output"] if i["type"] == "message"]
    [block] = msg["content"]
    assert block["type"] == "output_text"
    return block["text"]


def _workers(gw: str) -> dict[str, dict]:
    rows = httpx.get(f"{gw}/workers", headers=H, timeout=10).json()["workers"]
    return {w["addr"]: w for w in rows}


@pytest.fixture
def controller(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the agent is named relative to the repository root
    scheduler = LocalScheduler(str(tmp_path), "agent-svc", "t0")
    ctrl = AgentController(AgentConfig(agent_cls_path=AGENT, admin_api_key=KEY), scheduler)
    ctrl.initialize()
    try:
        yield ctrl
    finally:
        ctrl.destroy()
        scheduler.delete_workers()


def test_agent_service_turns_replay_history_route_by_session_and_fail_cleanly(controller):
    gw = controller.gateway_addr
    assert controller.router_addr == gw and len(controller.pairs) == 1
    assert httpx.get(f"{gw}/health", timeout=10).json()["workers"] == 1
    assert controller.scale_up(1) == [1] and sorted(controller.pairs) == [0, 1]

    # turns: the reply counts the user messages replayed to the agent
    r = _turn(gw, "alice", "hello")
    assert _text(r) == "turn 1: hello" and r.headers["X-AReaL-Session-Key"] == "alice"
    calls = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("count_turns", "{}")]
    assert _text(_turn(gw, "bob", "hi")) == "turn 1: hi"
    assert _text(_turn(gw, "alice", "again")) == "turn 2: again"
    hist = httpx.get(f"{gw}/session/alice/history", headers=H, timeout=10).json()["history"]
    assert [m["role"] for m in hist] == ["user", "assistant", "tool", "assistant"] * 2
    assert hist[1]["tool_calls"][0]["id"] == hist[2]["tool_call_id"]
    assert [m["content"] for m in hist if m["role"] == "user"] == ["hello", "again"]
    # stream=true: the finished turn as Responses SSE events
    r = _turn(gw, "carol", "streamed", stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    assert [e["type"] for e in events] == [
        "response.created", "response.output_text.delta", "response.output_text.done",
        "response.completed",
    ]  # fmt: skip
    assert events[1]["delta"] == "turn 1: streamed"
    assert events[-1]["response"]["status"] == "completed"
    # three sessions, two workers (new sessions go to the least-loaded worker)
    assert sorted(w["sessions"] for w in _workers(gw).values()) == [1, 2]

    # errors: a clear status and error.message; the history stays as it was
    r = _turn(gw, "alice", "hello", key="wrong")
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    r = httpx.post(f"{gw}/v1/responses", json={"input": "x"}, headers=H, timeout=10)
    assert r.status_code == 400 and "'user'" in r.json()["error"]["message"]
    r = _turn(gw, "alice", "x", inf_base_url="http://127.0.0.1:1")
    assert r.status_code == 400 and "session_api_key" in r.json()["error"]["message"]
    r = _turn(gw, "alice", "crash")
    assert r.status_code == 500 and "RuntimeError: asked to crash" in r.json()["error"]["message"]
    # a worker that dies mid-turn: 502 naming it; the session goes on elsewhere, history kept
    r = _turn(gw, "alice", "die")
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    assert _text(_turn(gw, "alice", "after")) == "turn 3: after"
    closed = httpx.post(f"{gw}/session/bob/close", headers=H, timeout=10).json()
    assert closed["closed"] is True
    assert httpx.get(f"{gw}/session/bob/history", headers=H, timeout=10).json()["history"] == []


def test_scale_down_drains_and_sessions_continue_on_the_other_worker(controller):
    gw = controller.gateway_addr
    controller.scale_up(1)
    for user in ("a", "b"):
        assert _text(_turn(gw, user, "one")) == "turn 1: one"
    removed_addr = controller.pairs[1].worker_addr
    assert controller.scale_down(1) == [1] and sorted(controller.pairs) == [0]
    assert removed_addr not in _workers(gw)
    for user in ("a", "b"):  # the removed worker's session keeps its history
        assert _text(_turn(gw, user, "two")) == "turn 2: two"
    assert [w["sessions"] for w in _workers(gw).values()] == [2]


def test_unknown_agent_path_fails_initialize_with_the_reason_and_leaves_nothing(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    scheduler = LocalScheduler(str(tmp_path), "agent-svc", "bad")
    cfg = AgentConfig(agent_cls_path="examples.agent_service.no_such.Agent", admin_api_key=KEY)
    ctrl = AgentController(cfg, scheduler, setup_timeout=60)
    with pytest.raises(RuntimeError, match="no_such"):
        ctrl.initialize()
    assert ctrl.gateway_addr == "" and ctrl.pairs == {}
    assert scheduler.dead_workers("agent-gateway") == []
    with pytest.raises(ValueError, match="agent_cls_path"):
        AgentController(AgentConfig(), scheduler)
    scheduler.delete_workers()


def test_a_turn_past_the_request_timeout_is_answered_504_and_the_next_turn_runs(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    scheduler = LocalScheduler(str(tmp_path), "agent-svc", "slow")
    cfg = AgentConfig(agent_cls_path=AGENT, admin_api_key=KEY)
    with AgentController(cfg, scheduler, request_timeout=1.0) as ctrl:
        r = _turn(ctrl.gateway_addr, "s", "sleep 3")
        assert r.status_code == 504 and "longer than 1 s" in r.json()["error"]["message"]
        assert _text(_turn(ctrl.gateway_addr, "s", "next")) == "turn 1: next"
    assert scheduler.dead_workers("agent-gateway") == []
    scheduler.delete_workers()


def test_training_mode_rewards_and_its_bad_config_errors(tmp_path, monkeypatch):
    """chat_agent's training mode: the reward rule; the operator's variables reach the
    workers through scheduling_spec[0].env_vars; half-set variables and a dead inference
    gateway fail the turn at once with the reason (the full run: the areal_checkout test)."""
    import asyncio

    from areal.api.cli_args import SchedulingSpec
    from areal.utils.network import find_free_ports
    from areal.v2.agent_service.types import AgentRequest
    from examples.agent_service import chat_agent as ca

    assert ca.arithmetic_reward("What is 7 * 6?", "it is 42.") == 1.0
    assert ca.arithmetic_reward("What is 2 + 3?", "5.5") == 0.0  # not a whole number
    assert ca.arithmetic_reward("What is 2 - 3?", "-1") == 1.0
    assert ca.arithmetic_reward("What is 2 + 3?", "15 or 50") == 0.0
    assert ca.arithmetic_reward("hello", "hi", default=0.5) == 0.5

    monkeypatch.chdir(REPO)
    monkeypatch.setenv(ca.INF_BASE_URL_ENV, "http://127.0.0.1:1")
    req = AgentRequest(message="What is 1 + 1?", session_key="s", run_id="r")
    with pytest.raises(ValueError, match="AREAL_AGENT_INF_ADMIN_KEY is not"):
        asyncio.run(ca.SessionChatAgent().run(req, emitter=None))
    monkeypatch.delenv(ca.INF_BASE_URL_ENV)  # the workers get only their spec's variables
    monkeypatch.delenv(ca.INF_ADMIN_KEY_ENV, raising=False)

    dead = f"http://127.0.0.1:{find_free_ports(1)[0]}"
    cases = {"half": {ca.INF_ADMIN_KEY_ENV: "k"}}
    cases["dead"] = {ca.INF_BASE_URL_ENV: dead, ca.INF_ADMIN_KEY_ENV: "k"}
    expected = {
        "half": "ValueError: AREAL_AGENT_INF_ADMIN_KEY is set but AREAL_AGENT_INF_BASE_URL is not",
        "dead": f"RuntimeError: inference gateway unreachable: {dead}/rl/start_session",
    }
    scheduler = LocalScheduler(str(tmp_path), "agent-svc", "train-mode")
    try:
        for name, env in cases.items():
            spec = SchedulingSpec(cpu=1, mem=1, env_vars=env)
            cfg = AgentConfig(agent_cls_path=AGENT, admin_api_key=KEY, scheduling_spec=[spec])
            with AgentController(cfg, scheduler) as ctrl:
                r = _turn(ctrl.gateway_addr, "u", "What is 1 + 1?")
                assert r.status_code == 500, r.text
                assert expected[name] in r.json()["error"]["message"]
                assert len(r.json()["error"]["message"]) < 200  # 2.0's client prints 200
    finally:
        scheduler.delete_workers()


def _drive_sessions(proxy: str, gw: str, admin: str, n: int, errors: list, done: list) -> None:
    """One client: per episode a session on the trainer's proxy, two agent turns whose
    model calls go through it, a reward, the end."""
    try:
        for episode in range(n):
            while True:  # until the trainer's proxy is up and grants a session
                try:
                    r = httpx.post(
                        f"{proxy}/rl/start_session",
                        json={"task_id": f"ep{episode}"},
                        headers={"Authorization": f"Bearer {admin}"},
                        timeout=60,
                    )
                except httpx.TransportError:
                    r = None
                if r is not None and r.status_code != 429:
                    break
                threading.Event().wait(0.2)
            assert r.status_code == 200, r.text
            key = r.json()["sessions"][0]["session_api_key"]
            route = {"inf_base_url": proxy, "session_api_key": key, "inf_model": "default"}
            for turn in (1, 2):
                r = _turn(gw, f"episode-{episode}", f"question {turn}", **route)
                assert r.status_code == 200, r.text
                assert r.json()["metadata"] == {"turn": turn, "model_call": True}
            hdr = {"Authorization": f"Bearer {key}"}
            reward = httpx.post(f"{proxy}/rl/set_reward", json={"reward": 1.0}, headers=hdr)
            assert reward.status_code == 200, reward.text
            httpx.post(f"{proxy}/rl/end_session", json={}, headers=hdr).raise_for_status()
            done.append(episode)
    except BaseException as e:  # reported by the test
        errors.append(e)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_online_ppo_three_steps_on_sessions_driven_through_the_agent_service(
    controller, tiny_lm_dir, tmp_path
):
    from test_rl_trainer import _grpo_config, _rows

    from areal import PPOTrainer
    from areal.utils.network import find_free_ports

    port = find_free_ports(1)[0]
    admin = "online-agent-admin"
    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=3",
        "allocation_mode=local:d1+fsdp:d1",
        "train_dataset.batch_size=1",
        "gconfig.n_samples=1",
        "rollout.agent.mode=online",
        f"rollout.agent.admin_api_key={admin}",
        f"rollout.agent.proxy_port={port}",
    )
    proxy = f"http://127.0.0.1:{port}"
    errors: list = []
    done: list = []
    client = threading.Thread(
        target=_drive_sessions,
        args=(proxy, controller.gateway_addr, admin, 3, errors, done),
        daemon=True,
    )
    client.start()
    with PPOTrainer(cfg, train_dataset=None) as trainer:
        result = trainer.train()
    client.join(timeout=120)
    assert not errors, errors
    assert done == [0, 1, 2]
    assert result["steps_done"] == 3
    rows = _rows(result["log_dir"])
    assert [r["batch/n_seqs"] for r in rows] == [2, 2, 2]  # two agent turns = two calls
    for r in rows:
        assert r["batch/reward"] == 1.0 and r["update_successful"] == 1.0
