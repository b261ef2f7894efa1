"""The agent service's gateway process: auth, session-affine routing and history.

::

    AREAL_AGENT_ADMIN_KEY=... python -m areal.v2.agent_service.gateway \\
        [--host 127.0.0.1] [--port 0] [--request-timeout 600] [--session-timeout 1800]

AReaL 2.0 splits this into a gateway, a router and one data proxy per worker (each its
own process). Here one process plays the three roles: the router's table and the data
proxies' histories are a few dictionaries, and keeping the history out of the workers
means a session survives its worker (a dead or scaled-down worker's sessions continue
on another worker with their whole conversation). The workers
(:mod:`areal.v2.agent_service.worker`) only run the agent.

Every path but ``/health`` needs the admin key (``Authorization: Bearer <key>``);
otherwise 401 with ``error.message``.

===============================  ===========================================================
path                             what
===============================  ===========================================================
``GET /health``                  ``{"status": "ok", "workers", "sessions"}`` (no key)
``POST /v1/responses``           one turn (OpenAI Responses shape, below)
``GET /session/{key}/history``   ``{"history": [...]}``: the conversation replayed to the agent
``POST /session/{key}/close``    forget the session; the agent's ``close_session``
``POST /register``               ``{"addr"}``: a worker takes new sessions
``POST /unregister``             ``{"addr", "remove"?}``: it takes no turns; its sessions move on
                                 their next turn (the controller waits for its in-flight
                                 turns: drain); ``remove``: forget it
``GET /workers``                 the workers: ``addr``, ``alive``, ``accepting``, ``inflight``,
                                 ``sessions``
===============================  ===========================================================

``/v1/responses`` body: ``input`` (a string, or items of type ``message`` whose
``content`` is a string or ``input_text`` blocks, and ``function_call_output`` items),
``instructions``, ``model``, ``user`` (the session key; or the ``X-AReaL-Session-Key``
header), ``metadata``, and optionally ``inf_base_url`` + ``session_api_key`` (+
``inf_model``): the inference gateway the agent's model calls go to, remembered for the
session and given to the agent as ``metadata["areal_inference"]``. The answer:
``{"id", "object": "response", "status": "completed", "model", "output": [...],
"metadata"}`` with a ``message`` item (``output_text`` block: the agent's ``summary``)
and a ``function_call`` item per tool call the agent emitted; the session key is echoed
in ``X-AReaL-Session-Key``. Turns of one session run one at a time, in arrival order.

Errors (``{"error": {"message", "type"}}``): 400 bad body or no session key, 401 wrong
key, 500 the agent raised (its message), 502 the worker could not be reached (it is
taken out; the session's history is kept and its next turn goes to a live worker), 503
no live worker, 504 the turn took longer than ``--request-timeout``. A failed turn
leaves the history unchanged. ``stream: true`` gives the finished turn as Responses SSE
events (``response.created``, ``response.output_text.delta`` / ``.done``,
``response.completed``), as 2.0 re-encodes it: the turn is not generated incrementally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from areal.utils import auth, logging
from areal.v2.agent_service.protocol import ADMIN_KEY_ENV, SESSION_KEY_HEADER, generate_run_id

logger = logging.getLogger("AgentGateway")


@dataclass
class WorkerSlot:
    addr: str
    alive: bool = True
    accepting: bool = True
    inflight: int = 0


@dataclass
class Session:
    key: str
    history: list[dict[str, Any]] = field(default_factory=list)
    inference: dict[str, str] | None = None
    worker: str | None = None
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class TurnError(Exception):
    def __init__(self, status: int, message: str, kind: str):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind}}
    return web.json_response(body, status=status, headers=headers)


def body_flag(request: web.Request, name: str) -> bool:
    body = request.get("body")
    return isinstance(body, dict) and bool(body.get(name))


def extract_message(input_items: Any, instructions: str = "") -> str:
    """The user text of a Responses ``input`` (a string or a list of items)."""
    parts = [instructions] if instructions else []
    if isinstance(input_items, str):
        parts.append(input_items)
        return "\n".join(parts)
    for item in input_items if isinstance(input_items, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content", "")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [
                    b.get("text", "")
                    for b in content
                    if isinstance(b, dict) and b.get("type") in ("input_text", "text")
                ]
        elif kind == "function_call_output":
            parts.append(f"[tool result] {item.get('output', '')}")
    return "\n".join(p for p in parts if p)


def turn_messages(message: str, run_id: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages one finished turn adds to the history: the user message, an
    assistant ``tool_calls`` message per tool call, a ``tool`` message per result (paired
    with the latest call of that name), then the assistant's reply."""
    out: list[dict[str, Any]] = [{"role": "user", "content": message}]
    last_call: dict[str, str] = {}
    for n, ev in enumerate(result.get("events") or []):
        if ev.get("type") == "tool_call":
            call_id = f"call_{run_id}_{n}"
            last_call[ev.get("name", "")] = call_id
            fn = {"name": ev.get("name", ""), "arguments": ev.get("args", "")}
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
                }
            )
        elif ev.get("type") == "tool_result":
            call_id = last_call.get(ev.get("name", ""), f"call_{run_id}_{n}")
            out.append({"role": "tool", "tool_call_id": call_id, "content": ev.get("result", "")})
    reply = reply_text(result)
    if reply:
        out.append({"role": "assistant", "content": reply})
    return out


def reply_text(result: dict[str, Any]) -> str:
    """The turn's reply: the agent's ``summary``, else its text deltas joined."""
    summary = result.get("summary") or ""
    if summary:
        return str(summary)
    return "".join(
        e.get("text", "") for e in result.get("events") or [] if e.get("type") == "delta"
    )


def output_items(run_id: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI Responses ``output``: the reply as a ``message``, each tool call as a
    ``function_call``."""
    items: list[dict[str, Any]] = []
    reply = reply_text(result)
    if reply:
        items.append(
            {
                "type": "message",
                "id": f"msg-{run_id}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply, "annotations": []}],
            }
        )
    for n, ev in enumerate(result.get("events") or []):
        if ev.get("type") == "tool_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": f"call_{run_id}_{n}",
                    "name": ev.get("name", ""),
                    "arguments": ev.get("args", ""),
                    "status": "completed",
                }
            )
    return items


class AgentGateway:
    """The handlers and state of the gateway process (module docstring)."""

    def __init__(
        self,
        admin_key: str,
        request_timeout: float = 600.0,
        session_timeout: float = 1800.0,
        health_interval: float = 5.0,
    ):
        self.admin_key = admin_key
        self.request_timeout = request_timeout
        self.session_timeout = session_timeout
        self.health_interval = health_interval
        self.workers: dict[str, WorkerSlot] = {}
        self.sessions: dict[str, Session] = {}
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/session/{key}/history", self.history)
        app.router.add_post("/session/{key}/close", self.close_session)
        app.router.add_post("/register", self.register)
        app.router.add_post("/unregister", self.unregister)
        app.router.add_get("/workers", self.list_workers)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health":
            key = auth.extract_key(request.headers)
            if key is None or not auth.keys_equal(key, self.admin_key):
                reason = "missing API key" if key is None else "wrong API key"
                auth.log_rejection(request.method, request.path, request.remote, reason, "agent")
                return _error(401, f"unauthorized: {reason} (the admin key is required)", "auth")
        return await handler(request)

    async def _start(self, app: web.Application) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._tasks = [asyncio.create_task(self._reap_loop())]
        if self.health_interval > 0:
            self._tasks.append(asyncio.create_task(self._health_loop()))

    async def _stop(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------------------------ background
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            for w in list(self.workers.values()):
                w.alive = await self._probe(w.addr)

    async def _probe(self, addr: str) -> bool:
        assert self._http is not None
        try:
            async with self._http.get(
                f"{addr}/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, max(1.0, self.session_timeout / 4)))
            now = time.monotonic()
            for key, s in list(self.sessions.items()):
                if now - s.last_active > self.session_timeout and not s.lock.locked():
                    del self.sessions[key]
                    await self._close_on_worker(s)
                    logger.info("session %s idle for %.0f s: dropped", key, now - s.last_active)

    # ------------------------------------------------------------------ control paths
    async def health(self, request: web.Request) -> web.Response:
        live = sum(w.alive and w.accepting for w in self.workers.values())
        return web.json_response({"status": "ok", "workers": live, "sessions": len(self.sessions)})

    @staticmethod
    async def _addr(request: web.Request) -> str:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        addr = body.get("addr") if isinstance(body, dict) else None
        request["body"] = body
        if not isinstance(addr, str) or not addr.startswith("http"):
            raise TurnError(400, 'the body must be {"addr": "http://host:port"}', "invalid_request")
        return addr.rstrip("/")

    async def register(self, request: web.Request) -> web.Response:
        try:
            addr = await self._addr(request)
        except TurnError as e:
            return _error(e.status, e.message, e.kind)
        self.workers[addr] = WorkerSlot(addr)
        logger.info("worker %s registered (%d in all)", addr, len(self.workers))
        return web.json_response({"status": "ok", "workers": len(self.workers)})

    async def unregister(self, request: web.Request) -> web.Response:
        try:
            addr = await self._addr(request)
        except TurnError as e:
            return _error(e.status, e.message, e.kind)
        w = self.workers.get(addr)
        if w is None:
            return _error(404, f"worker {addr} is not registered", "not_found")
        w.accepting = False
        if body_flag(request, "remove"):
            del self.workers[addr]
        moved = 0
        for s in self.sessions.values():
            if s.worker == addr:
                s.worker, moved = None, moved + 1
        logger.info("worker %s unregistered: %d session(s) move on their next turn", addr, moved)
        return web.json_response({"status": "ok", "inflight": w.inflight, "sessions_moved": moved})

    async def list_workers(self, request: web.Request) -> web.Response:
        pinned: dict[str, int] = {}
        for s in self.sessions.values():
            if s.worker is not None:
                pinned[s.worker] = pinned.get(s.worker, 0) + 1
        rows = [{**w.__dict__, "sessions": pinned.get(w.addr, 0)} for w in self.workers.values()]
        return web.json_response({"workers": rows})

    async def history(self, request: web.Request) -> web.Response:
        s = self.sessions.get(request.match_info["key"])
        return web.json_response({"history": [] if s is None else s.history})

    async def close_session(self, request: web.Request) -> web.Response:
        s = self.sessions.pop(request.match_info["key"], None)
        if s is not None:
            await self._close_on_worker(s)
        return web.json_response({"status": "ok", "closed": s is not None})

    async def _close_on_worker(self, s: Session) -> None:
        w = self.workers.get(s.worker or "")
        if w is None or not w.alive or self._http is None:
            return
        try:
            async with self._http.post(
                f"{w.addr}/session/{s.key}/close",
                headers={"Authorization": f"Bearer {self.admin_key}"},
                timeout=aiohttp.ClientTimeout(total=10),
            ):
                pass
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("closing session %s on %s failed: %s", s.key, w.addr, e)

    # ------------------------------------------------------------------ turns
    def _pick(self, s: Session) -> WorkerSlot:
        w = self.workers.get(s.worker or "")
        if w is not None and w.alive and w.accepting:
            return w
        live = [w for w in self.workers.values() if w.alive and w.accepting]
        if not live:
            raise TurnError(503, "no live agent worker behind the gateway", "no_worker")
        pinned = {a: 0 for a in self.workers}
        for other in self.sessions.values():
            if other.worker in pinned:
                pinned[other.worker] += 1
        w = min(live, key=lambda w: (pinned[w.addr], w.inflight))
        s.worker = w.addr
        return w

    @staticmethod
    def _inference(s: Session, body: dict[str, Any]) -> None:
        base = str(body.get("inf_base_url") or "").rstrip("/")
        key = str(body.get("session_api_key") or "")
        if not base and not key:
            return
        if not base or not key:
            raise TurnError(
                400, "routing model calls needs both 'inf_base_url' and 'session_api_key'",
                "invalid_request",
            )  # fmt: skip
        s.inference = {"base_url": base, "api_key": key, "model": str(body.get("inf_model") or "")}

    async def _run_turn(self, w: WorkerSlot, payload: dict[str, Any]) -> dict[str, Any]:
        assert self._http is not None
        w.inflight += 1
        try:
            async with self._http.post(
                f"{w.addr}/run",
                json=payload,
                headers={"Authorization": f"Bearer {self.admin_key}"},
                timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=5),
            ) as r:
                text = await r.text()
                status = r.status
        except TimeoutError:
            raise TurnError(
                504, f"the agent's turn took longer than {self.request_timeout:.0f} s", "timeout"
            ) from None
        except aiohttp.ClientError as e:
            w.alive = False
            raise TurnError(
                502,
                f"agent worker {w.addr} is unreachable ({type(e).__name__}: {e}); it is taken "
                "out, the session's history is kept: retry the turn",
                "worker_unreachable",
            ) from None
        finally:
            w.inflight -= 1
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = {"error": {"message": text[:2000], "type": "worker_error"}}
        if status != 200:
            err = data.get("error") if isinstance(data, dict) else None
            message = err.get("message", text) if isinstance(err, dict) else text
            kind = err.get("type", "worker_error") if isinstance(err, dict) else "worker_error"
            raise TurnError(500 if status >= 500 else status, str(message), str(kind))
        return data

    async def responses(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"malformed JSON body: {e}", "invalid_request")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request")
        key = request.headers.get(SESSION_KEY_HEADER) or body.get("user")
        if not isinstance(key, str) or not key:
            return _error(
                400, f"the 'user' field (or the {SESSION_KEY_HEADER} header) names the session "
                "and is required", "invalid_request",
            )  # fmt: skip
        echo = {SESSION_KEY_HEADER: key}
        message = extract_message(body.get("input", []), str(body.get("instructions") or ""))
        if not message:
            return _error(400, "'input' has no message text", "invalid_request", echo)
        model = str(body.get("model") or "")
        s = self.sessions.get(key)
        if s is None:
            s = self.sessions[key] = Session(key)
        run_id = generate_run_id()
        try:
            self._inference(s, body)
            async with s.lock:
                metadata = {
                    "input": body.get("input", []),
                    "instructions": body.get("instructions", ""),
                    "tools": body.get("tools", []),
                    "model": model,
                    **(extra if isinstance(extra := body.get("metadata"), dict) else {}),
                }
                if s.inference is not None:
                    metadata["areal_inference"] = dict(s.inference)
                payload = {
                    "message": message,
                    "session_key": key,
                    "run_id": run_id,
                    "history": list(s.history),
                    "queue_mode": str(body.get("queue_mode") or "collect"),
                    "metadata": metadata,
                }
                result = await self._run_turn(self._pick(s), payload)
                s.history += turn_messages(message, run_id, result)
                s.last_active = time.monotonic()
        except TurnError as e:
            logger.warning("session %s turn %s failed (%d): %s", key, run_id, e.status, e.message)
            return _error(e.status, e.message, e.kind, echo)
        answer = {
            "id": f"resp-{uuid.uuid4().hex[:12]}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": model,
            "output": output_items(run_id, result),
            "metadata": result.get("metadata") or {},
        }
        if body.get("stream"):
            return await self._stream(request, answer, echo)
        return web.json_response(answer, headers=echo)

    @staticmethod
    async def _stream(request: web.Request, answer: dict, headers: dict) -> web.StreamResponse:
        """The finished turn as OpenAI Responses SSE events: ``response.created``, the
        reply's ``response.output_text.delta`` / ``.done``, ``response.completed`` (whose
        ``response`` is the non-streamed answer)."""
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = {**answer, "status": "in_progress", "output": []}
        events: list[dict[str, Any]] = [{"type": "response.created", "response": created}]
        for item in answer["output"]:
            for block in item.get("content", []) if item["type"] == "message" else []:
                events.append({"type": "response.output_text.delta", "delta": block["text"]})
                events.append({"type": "response.output_text.done", "text": block["text"]})
        events.append({"type": "response.completed", "response": answer})
        for ev in events:
            await resp.write(f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode())
        await resp.write_eof()
        return resp


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="areal agent-service gateway")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per turn")
    p.add_argument("--session-timeout", type=float, default=1800.0, help="idle seconds")
    p.add_argument("--health-interval", type=float, default=5.0, help="worker probes; 0: off")
    args = p.parse_args(argv)
    key = os.environ.get(ADMIN_KEY_ENV) or auth.DEFAULT_ADMIN_KEY
    auth.refuse_default_key_off_loopback(
        args.host, key, "the agent-service gateway", f"--admin-api-key or {ADMIN_KEY_ENV}"
    )
    gateway = AgentGateway(key, args.request_timeout, args.session_timeout, args.health_interval)
    logger.info("agent gateway on %s:%d", args.host, args.port)
    web.run_app(gateway.make_app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
