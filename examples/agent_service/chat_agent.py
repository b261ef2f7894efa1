"""A small agent for the agent service (``areal agent run --agent
examples.agent_service.chat_agent.SessionChatAgent``).

Per turn it answers the user's message with one model call when the turn routes model
calls to an inference gateway (``metadata["areal_inference"]``: the client sent
``inf_base_url`` + ``session_api_key``): the replayed ``history`` plus the new message go
to ``{base_url}/chat/completions`` under the session's key, so the call is recorded for
training. Without a gateway it answers offline with ``turn N: <message>`` (N counts the
user messages of the history, so the reply shows the history was replayed).

Training mode (the operator's, not the client's): when the worker's environment names
an inference gateway, ``AREAL_AGENT_INF_BASE_URL`` (e.g. an online trainer's proxy) and
``AREAL_AGENT_INF_ADMIN_KEY`` (its admin key), every turn that carries no
``areal_inference`` of its own is one training episode, so a client that only chats
(AReaL 2.0's ``run_agent_service.py``) drives training:

1. ``POST /rl/start_session`` with the admin key (on 429, the trainer admits no episode
   now, it retries for up to ``AREAL_AGENT_GRANT_TIMEOUT`` seconds, default 60);
2. the model call above, under the new session's key;
3. ``POST /rl/set_reward`` with :func:`arithmetic_reward` of the message and the reply,
   then ``POST /rl/end_session``.

The reward rule: a message with an integer question ``A + B`` / ``A - B`` / ``A * B``
(the first one in it) scores 1.0 when the reply contains the answer as a whole number,
else 0.0; any other message scores ``AREAL_AGENT_DEFAULT_REWARD`` (default 0.0: a fixed
reward for demos). ``AREAL_AGENT_INF_MODEL`` names the model (default ``default``).
The turn reports the reward as a ``set_reward`` tool call (its result: the session id)
and in the response's ``metadata`` (``reward``, ``session_id``). A half-set pair of
variables or an unreachable gateway fails the turn at once, with the reason in the
client's ``error.message``. Operators set the variables through
``AgentConfig.scheduling_spec[0].env_vars``, which reach every agent worker.

Each turn also reports one tool call and its result (``count_turns``), which clients see
as a ``function_call`` output item. Test hooks: a message ``crash`` raises, ``die``
ends the worker process, ``sleep S`` waits S seconds first.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from typing import Any

import httpx

from areal.v2.agent_service.types import AgentRequest, AgentResponse, EventEmitter

MAX_TOKENS = int(os.environ.get("CHAT_AGENT_MAX_TOKENS", "16"))
INF_BASE_URL_ENV = "AREAL_AGENT_INF_BASE_URL"
INF_ADMIN_KEY_ENV = "AREAL_AGENT_INF_ADMIN_KEY"
INF_MODEL_ENV = "AREAL_AGENT_INF_MODEL"
DEFAULT_REWARD_ENV = "AREAL_AGENT_DEFAULT_REWARD"
GRANT_TIMEOUT_ENV = "AREAL_AGENT_GRANT_TIMEOUT"

_QUESTION = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?!\.?\d)")


def arithmetic_reward(message: str, reply: str, default: float = 0.0) -> float:
    """The training mode's reward rule (module docstring)."""
    m = _QUESTION.search(message)
    if m is None:
        return default
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return 1.0 if str(answer) in _NUMBER.findall(reply) else 0.0


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def training_gateway() -> dict[str, str] | None:
    """The operator's inference gateway from the environment; None when neither variable
    is set, ``ValueError`` when only one is."""
    url = os.environ.get(INF_BASE_URL_ENV, "").rstrip("/")
    key = os.environ.get(INF_ADMIN_KEY_ENV, "")
    if not url and not key:
        return None
    if not url or not key:
        have, lack = (
            (INF_BASE_URL_ENV, INF_ADMIN_KEY_ENV) if url else (INF_ADMIN_KEY_ENV, INF_BASE_URL_ENV)
        )
        raise ValueError(f"{have} is set but {lack} is not: set both or neither")
    return {"base_url": url, "admin_key": key, "model": os.environ.get(INF_MODEL_ENV, "default")}


class SessionChatAgent:
    def __init__(self, **_: Any) -> None:
        self.closed: list[str] = []

    async def run(self, request: AgentRequest, *, emitter: EventEmitter) -> AgentResponse:
        if request.message.strip() == "crash":
            raise RuntimeError("asked to crash")
        if request.message.strip() == "die":
            os._exit(3)
        if request.message.startswith("sleep "):
            await asyncio.sleep(float(request.message.split()[1]))
        upstream = request.metadata.get("areal_inference")
        trainer = None if upstream else training_gateway()
        turn = 1 + sum(m.get("role") == "user" for m in request.history)
        await emitter.emit_tool_call("count_turns", "{}")
        await emitter.emit_tool_result("count_turns", str(turn))
        if trainer is not None:
            return await self._episode(trainer, request, emitter, turn)
        if upstream:
            reply = await self._chat(upstream, request)
        else:
            reply = f"turn {turn}: {request.message}"
        await emitter.emit_delta(reply)
        return AgentResponse(summary=reply, metadata={"turn": turn, "model_call": bool(upstream)})

    async def _episode(
        self, trainer: dict[str, str], request: AgentRequest, emitter: EventEmitter, turn: int
    ) -> AgentResponse:
        """One turn = one training episode (module docstring, "Training mode")."""
        url = trainer["base_url"]
        default = _env_float(DEFAULT_REWARD_ENV, 0.0)
        async with httpx.AsyncClient(timeout=30) as http:
            session_id, key = await _start_session(http, url, trainer["admin_key"], request)
            session = {"Authorization": f"Bearer {key}"}
            try:
                upstream = {"base_url": url, "api_key": key, "model": trainer["model"]}
                reply = await self._chat(upstream, request)
                reward = arithmetic_reward(request.message, reply, default)
                await _post(http, f"{url}/rl/set_reward", {"reward": reward}, session)
            finally:  # the trainer's rollout task waits for this session's end
                try:
                    await http.post(f"{url}/rl/end_session", json={}, headers=session)
                except httpx.TransportError:
                    pass
        await emitter.emit_tool_call("set_reward", json.dumps({"reward": reward}))
        await emitter.emit_tool_result("set_reward", session_id)
        await emitter.emit_delta(reply)
        meta = {"turn": turn, "model_call": True, "reward": reward, "session_id": session_id}
        return AgentResponse(summary=reply, metadata=meta)

    @staticmethod
    async def _chat(upstream: dict[str, str], request: AgentRequest) -> str:
        messages = [
            {"role": m["role"], "content": m["content"]}
            for m in request.history
            if m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
        ]
        messages.append({"role": "user", "content": request.message})
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(
                f"{upstream['base_url']}/chat/completions",
                json={
                    "model": upstream.get("model") or "default",
                    "messages": messages,
                    "max_tokens": MAX_TOKENS,
                },
                headers={"Authorization": f"Bearer {upstream['api_key']}"},
            )
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"] or ""

    async def close_session(self, session_key: str) -> None:
        self.closed.append(session_key)


async def _post(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    ok: tuple[int, ...] = (200, 201),
) -> httpx.Response:
    """POST; a gateway that cannot be reached or answers an error raises ``RuntimeError``
    naming the URL and the reason."""
    try:
        r = await http.post(url, json=body, headers=headers)
    except httpx.TransportError as e:
        raise RuntimeError(f"inference gateway unreachable: {url}: {type(e).__name__}") from e
    if r.status_code not in ok:
        raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:120]}")
    return r


async def _start_session(
    http: httpx.AsyncClient, url: str, admin_key: str, request: AgentRequest
) -> tuple[str, str]:
    """``/rl/start_session`` with the admin key, retried on 429 (no grant yet) up to
    ``AREAL_AGENT_GRANT_TIMEOUT`` s; the new session's id and key."""
    timeout = _env_float(GRANT_TIMEOUT_ENV, 60.0)
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {admin_key}"}
    body = {"task_id": f"agent-{request.run_id or request.session_key}"}
    while True:
        r = await _post(http, f"{url}/rl/start_session", body, headers, (200, 201, 429))
        if r.status_code != 429:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} granted no training session in {timeout:.0f} s (429)")
        await asyncio.sleep(0.2)
    data = r.json()
    first = (data.get("sessions") or [{}])[0]
    key = first.get("session_api_key") or data.get("api_key")
    return str(first.get("session_id") or data.get("session_id")), str(key)
