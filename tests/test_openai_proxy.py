"""The OpenAI-compatible proxy against a REAL built-in inference server, with real SDKs.

One proxy (uvicorn on 127.0.0.1, its own thread) in front of one built-in server serving
a random tiny model with the project's tiny tokenizer. The engine is wrapped by a
recorder so exports can be compared with what the server actually returned.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from _agent_tokens import RecordingEngine, assert_concat_row_is_the_calls, proxy_session_turns
from _local_engine import local_engine

pytestmark = [pytest.mark.timeout(300)]

import httpx2 as httpx  # noqa: E402
import openai  # noqa: E402

from areal.experimental.openai import ArealOpenAI  # noqa: E402
from areal.experimental.openai.proxy import ProxyServer  # noqa: E402

ADMIN = "test-admin-key"
QUESTION = [{"role": "user", "content": "Mia has 3 apples. She buys 4 more. How many?"}]


@pytest.fixture(scope="module")
def engine(tiny_lm_dir):
    with local_engine(tiny_lm_dir) as eng:
        yield RecordingEngine(eng)


@pytest.fixture(scope="module")
def proxy(engine, tiny_lm_dir):
    from areal.utils.hf_utils import load_hf_tokenizer

    tok = load_hf_tokenizer(tiny_lm_dir)
    client = ArealOpenAI(engine, tok, chat_template_type="concat", engine_max_tokens=256)
    with ProxyServer(client, admin_api_key=ADMIN) as srv:
        yield srv


def _run(coro):
    return asyncio.run(coro)


def _admin_post(proxy, path, payload, key=ADMIN):
    return httpx.post(
        f"{proxy.base_url}/{path}",
        json=payload,
        headers={"Authorization": f"Bearer {key}"} if key else {},
        timeout=60,
    )


def _session(proxy):
    r = _admin_post(proxy, "rl/start_session", {"task_id": "x"})
    assert r.status_code == 200, r.text
    return r.json()


def _export(proxy, session_id, discount=1.0, style="individual"):
    from areal.experimental.openai.proxy import deserialize_interactions

    r = _admin_post(
        proxy,
        "export_trajectories",
        {"session_id": session_id, "discount": discount, "style": style},
    )
    assert r.status_code == 200, r.text
    return deserialize_interactions(r.json()["interactions"])


def _end(proxy, key):
    r = httpx.post(f"{proxy.base_url}/rl/end_session", json={}, headers={"x-api-key": key})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- OpenAI SDK
@pytest.mark.slow
def test_chat_sync_sdk_round_trip_exports_server_tokens(proxy, engine):
    s = _session(proxy)
    client = openai.OpenAI(base_url=proxy.base_url, api_key=s["api_key"])
    n0 = len(engine.calls)
    out = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=12, temperature=1.0
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    req, resp = engine.calls[n0]
    assert out.usage.completion_tokens == len(resp.output_tokens)
    _end(proxy, s["api_key"])
    exported = _export(proxy, s["session_id"])
    assert list(exported) == [out.id]
    row = exported[out.id].to_tensor_dict()
    assert row["input_ids"][0].tolist() == list(req.input_ids) + list(resp.output_tokens)
    n_in = len(req.input_ids)
    assert row["loss_mask"][0].tolist() == [0] * n_in + [1] * len(resp.output_tokens)
    assert torch.equal(row["logprobs"][0, n_in:], torch.tensor(resp.output_logprobs))


@pytest.mark.slow
def test_chat_v1_base_url_async_and_stream_match_recorded_output(proxy, engine):
    s = _session(proxy)

    async def go():
        client = openai.AsyncOpenAI(base_url=proxy.base_url + "/v1", api_key=s["api_key"])
        plain = await client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=10, seed=3
        )
        n0 = len(engine.calls)
        stream = await client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=10, stream=True
        )
        chunks = [c async for c in stream]
        await client.close()
        return plain, chunks, engine.calls[n0]

    plain, chunks, (req, resp) = _run(go())
    assert plain.choices[0].message.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(resp.output_tokens)
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    _end(proxy, s["api_key"])
    exported = _export(proxy, s["session_id"])
    assert set(exported) == {plain.id, ids.pop()}
    # the decoded stream text equals the recorded output's decoding
    stripped = [t for t in resp.output_tokens if t not in (req.gconfig.stop_token_ids or [])]
    assert text == req.tokenizer.decode(stripped, skip_special_tokens=True)


@pytest.mark.slow
def test_chat_stream_raw_sse_ends_with_done(proxy):
    s = _session(proxy)
    with httpx.stream(
        "POST",
        f"{proxy.base_url}/chat/completions",
        json={"model": "m", "messages": QUESTION, "max_tokens": 5, "stream": True},
        headers={"Authorization": f"Bearer {s['api_key']}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


@pytest.mark.slow
def test_responses_api_round_trip_recorded(proxy):
    s = _session(proxy)
    client = openai.OpenAI(base_url=proxy.base_url, api_key=s["api_key"])
    out = client.responses.create(model="m", input="What is 2 + 3?", max_output_tokens=8)
    assert out.object == "response" and out.usage.output_tokens >= 1
    _end(proxy, s["api_key"])
    assert list(_export(proxy, s["session_id"])) == [out.id]


# ----------------------------------------------------------------------------- Anthropic SDK
@pytest.mark.slow
def test_anthropic_messages_sdk_plain_and_stream(proxy, engine):
    import anthropic

    s = _session(proxy)
    client = anthropic.Anthropic(base_url=proxy.base_url, api_key=s["api_key"])
    n0 = len(engine.calls)
    msg = client.messages.create(
        model="tiny",
        max_tokens=10,
        system="You are a calculator.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "2 + 2?"}]}],
    )
    req, resp = engine.calls[n0]
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text"
    assert msg.usage.output_tokens == len(resp.output_tokens)
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model="tiny", max_tokens=6, messages=[{"role": "user", "content": "1 + 1?"}]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens >= 1
    # The message id is the interaction id: rewards can target it.
    r = httpx.post(
        f"{proxy.base_url}/rl/set_reward",
        json={"interaction_id": msg.id, "reward": 0.5},
        headers={"x-api-key": s["api_key"]},
    )
    assert r.status_code == 200, r.text
    _end(proxy, s["api_key"])
    exported = _export(proxy, s["session_id"])
    assert set(exported) == {msg.id, streamed.id}
    assert exported[msg.id].reward == 0.5


# ----------------------------------------------------------------------------- export
async def _three_turn_session(proxy, engine, discount, style, reward_last=1.0):
    return await proxy_session_turns(
        proxy,
        ADMIN,
        engine,
        list(QUESTION),
        ("Are you sure?", "Check again."),
        discount,
        style,
        reward_last,
        model="m",
        max_tokens=8,
    )


@pytest.mark.slow
def test_three_turn_concat_export_is_token_exact(proxy, engine):
    ids, exported, calls = _run(_three_turn_session(proxy, engine, 1.0, "concat"))
    assert list(exported) == [ids[-1]]  # one linear conversation -> one row
    row = exported[ids[-1]].to_tensor_dict()
    # Each turn's prompt extends the previous turn's exact tokens, the row is the server's
    # tokens, and the loss mask covers exactly the three generated outputs (their
    # logprobs and versions, bit-exact after the JSON round trip).
    assert_concat_row_is_the_calls(row, calls, calls[0][0].tokenizer.eos_token_id)
    assert float(row["rewards"][0]) == 1.0


@pytest.mark.slow
def test_three_turn_reward_discount_applied_once(proxy, engine):
    ids, exported, _ = _run(_three_turn_session(proxy, engine, 0.5, "individual", 1.0))
    assert list(exported) == ids
    assert [exported[i].reward for i in ids] == [0.25, 0.5, 1.0]
    rows = [exported[i].to_tensor_dict()["rewards"].item() for i in ids]
    assert rows == [0.25, 0.5, 1.0]


# ----------------------------------------------------------------------------- keys
@pytest.mark.slow
def test_requests_without_or_with_wrong_key_get_401(proxy):
    a, b = _session(proxy), _session(proxy)
    chat = {"model": "m", "messages": QUESTION, "max_tokens": 2}
    assert httpx.post(f"{proxy.base_url}/chat/completions", json=chat).status_code == 401
    r = _admin_post(proxy, "chat/completions", chat, key="sk-nope")
    assert r.status_code == 401 and "unauthorized" in r.json()["error"]["message"]
    # the admin key is not a session: no chat with it
    assert _admin_post(proxy, "chat/completions", chat).status_code == 401
    # a session key on admin endpoints
    for path, body in (
        ("rl/start_session", {"task_id": "y"}),
        ("export_trajectories", {"session_id": b["session_id"]}),
        ("grant_capacity", {}),
    ):
        assert _admin_post(proxy, path, body, key=a["api_key"]).status_code == 401, path
        assert _admin_post(proxy, path, body, key=None).status_code == 401, path
    # a session's key cannot reward another session's call
    out = openai.OpenAI(base_url=proxy.base_url, api_key=b["api_key"]).chat.completions.create(
        **chat
    )
    r = httpx.post(
        f"{proxy.base_url}/rl/set_reward",
        json={"interaction_id": out.id, "reward": 1.0},
        headers={"Authorization": f"Bearer {a['api_key']}"},
    )
    assert r.status_code == 400 and "not found" in r.text
    # an ended session's key is revoked
    _end(proxy, a["api_key"])
    assert _admin_post(proxy, "chat/completions", chat, key=a["api_key"]).status_code == 401
    _end(proxy, b["api_key"])
    # the refused calls recorded nothing: a has no interaction, b only its own call
    assert _export(proxy, a["session_id"]) == {}
    assert list(_export(proxy, b["session_id"])) == [out.id]


@pytest.mark.slow
def test_garbage_bodies_get_4xx_and_proxy_stays_up(proxy):
    s = _session(proxy)
    url = f"{proxy.base_url}/chat/completions"
    hdr = {"Authorization": f"Bearer {s['api_key']}", "Content-Type": "application/json"}
    garbage = [
        b"",
        b"{",
        b"not json at all",
        b"[]",
        b'"a string"',
        b"null",
        b"{}",
        b'{"messages": "hello"}',
        b'{"messages": []}',
        b'{"messages": [1, 2]}',
        b'{"messages": [{"role": "user", "content": "x"}], "n": 3}',
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
        b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes please"}',
        b"\xff\xfe\x00garbage",
        b"[" * 5000 + b"]" * 5000,
    ]
    statuses = []
    for _ in range(3):
        for g in garbage:
            statuses.append(httpx.post(url, content=g, headers=hdr, timeout=30).status_code)
    assert all(400 <= c < 500 for c in statuses), statuses
    for path in ("rl/set_reward", "rl/start_session", "export_trajectories", "v1/messages"):
        key = ADMIN if path in ("rl/start_session", "export_trajectories") else s["api_key"]
        r = httpx.post(
            f"{proxy.base_url}/{path}",
            content=b'{"reward": "high", "task_id": 5, "session_id": [], "max_tokens": 0}',
            headers={"Authorization": f"Bearer {key}"},
        )
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert httpx.get(f"{proxy.base_url}/health").json()["status"] == "ok"
    out = openai.OpenAI(base_url=proxy.base_url, api_key=s["api_key"]).chat.completions.create(
        model="m", messages=QUESTION, max_tokens=3
    )
    assert out.usage.completion_tokens >= 1
    _end(proxy, s["api_key"])
    assert len(_export(proxy, s["session_id"])) == 1


@pytest.mark.slow
def test_set_reward_after_end_and_unknown_session_export_are_client_errors(proxy):
    s = _session(proxy)
    r = httpx.post(
        f"{proxy.base_url}/rl/set_reward",
        json={"reward": 1.0},
        headers={"Authorization": f"Bearer {s['api_key']}"},
    )
    assert r.status_code == 400  # no interactions yet
    _end(proxy, s["api_key"])
    assert _export(proxy, s["session_id"]) == {}
    r = _admin_post(proxy, "export_trajectories", {"session_id": s["session_id"]})
    assert r.status_code == 404


# ----------------------------------------------------------------------------- own process
@pytest.mark.slow
def test_proxy_process_entry_point_serves_sdk_and_stops_on_sigterm(engine, tiny_lm_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    addr_file = tmp_path / "proxy_addr"
    env = dict(os.environ, AREAL_PROXY_ADMIN_KEY="proc-admin")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.experimental.openai.proxy",
            "--server-addrs",
            ",".join(engine.engine.addresses),
            "--tokenizer",
            tiny_lm_dir,
            "--addr-file",
            str(addr_file),
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not addr_file.exists():
            assert proc.poll() is None, "the proxy process exited"
            assert time.monotonic() < deadline, "the proxy process did not come up"
            time.sleep(0.2)
        base = addr_file.read_text()
        assert base.startswith("http://127.0.0.1:")
        r = httpx.post(
            f"{base}/rl/start_session",
            json={"task_id": "p"},
            headers={"Authorization": "Bearer proc-admin"},
        )
        assert r.status_code == 200, r.text
        key = r.json()["api_key"]
        out = openai.OpenAI(base_url=base, api_key=key).chat.completions.create(
            model="m", messages=QUESTION, max_tokens=4
        )
        assert out.usage.completion_tokens >= 1
        assert (
            httpx.post(
                f"{base}/rl/start_session", json={}, headers={"x-api-key": ADMIN}
            ).status_code
            == 401
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


# ----------------------------------------------------------------------------- fast: formats
def test_anthropic_request_with_tool_blocks_translates_to_chat_messages():
    from areal.experimental.openai.proxy.anthropic_format import anthropic_to_openai

    args = anthropic_to_openai(
        {
            "model": "m",
            "max_tokens": 20,
            "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"],
            "tools": [{"name": "calc", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "1+1?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me see."},
                        {"type": "tool_use", "id": "tu1", "name": "calc", "input": {"e": "1+1"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "tu1", "content": "2"},
                        {"type": "text", "text": "So?"},
                    ],
                },
            ],
        }
    )
    assert args["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {
                    "id": "tu1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"e": "1+1"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "tu1", "content": "2"},
        {"role": "user", "content": "So?"},
    ]
    assert args["max_tokens"] == 20 and args["stop"] == ["END"]
    assert args["tool_choice"] == "required"
    assert args["tools"][0]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize(
    "bad",
    [
        {"messages": []},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
    ],
)
def test_anthropic_request_unsupported_parts_raise_value_error(bad):
    from areal.experimental.openai.proxy.anthropic_format import anthropic_to_openai

    with pytest.raises(ValueError):
        anthropic_to_openai({"max_tokens": 5, **bad})


def test_export_serialization_round_trip_is_exact():
    from areal.api.io_struct import ModelResponse
    from areal.experimental.openai.proxy import deserialize_interactions, serialize_interactions
    from areal.experimental.openai.types import InteractionWithTokenLogpReward

    resp = ModelResponse(
        input_tokens=[5, 6, 7],
        output_tokens=[8, 9],
        output_logprobs=[-0.123456789, -2.5e-8],
        output_versions=[3, 4],
        stop_reason="length",
    )
    it = InteractionWithTokenLogpReward(
        model_response=resp, reward=0.75, messages=[{"role": "user"}]
    )
    it.interaction_id = "chatcmpl-x"
    wire = json.loads(json.dumps(serialize_interactions({"chatcmpl-x": it})))
    back = deserialize_interactions(wire)["chatcmpl-x"]
    a, b = it.to_tensor_dict(), back.to_tensor_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert back.reward == 0.75 and back.interaction_id == "chatcmpl-x"


def test_sessions_left_at_stop_are_counted_and_logged_not_silently_dropped(caplog):
    """An online run's last session (still open when the trainer stops) and an ended,
    never exported one: ``stop`` counts both in ``sessions_dropped_at_stop`` and logs
    them; a second ``stop`` does not count them again. No model calls (``client=None``)."""
    import logging

    srv = ProxyServer(client=None, admin_api_key=ADMIN).start()
    started = []
    for task in ("open", "ended"):
        r = _admin_post(srv, "rl/start_session", {"task_id": task})
        assert r.status_code == 200, r.text
        started.append(r.json())
    ids = [s["session_id"] for s in started]
    r = httpx.post(
        f"{srv.base_url}/rl/end_session",
        headers={"Authorization": f"Bearer {started[1]['api_key']}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    with caplog.at_level(logging.WARNING, logger="areal"):
        srv.stop()
        srv.stop()
    assert srv.state.stats["sessions_dropped_at_stop"] == 2
    lines = [r.getMessage() for r in caplog.records if "not exported" in r.getMessage()]
    assert len(lines) == 1 and "(1 open, 1 ended" in lines[0]
    assert all(sid in lines[0] for sid in ids)
