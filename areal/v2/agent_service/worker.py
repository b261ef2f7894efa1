"""The agent worker process: one agent instance behind ``POST /run``.

::

    AREAL_AGENT_ADMIN_KEY=... python -m areal.v2.agent_service.worker \\
        --agent pkg.module.Class [--host 127.0.0.1] [--port 0]

At start the worker imports ``--agent`` and builds one instance; an import path that
does not resolve, or a class without ``async def run``, ends the process with exit code
2 and the reason in its log (the controller raises it with the log's tail). It keeps no
session state of its own: the gateway sends each turn's conversation.

========================================  =====  ===========================================
path                                      key    what
========================================  =====  ===========================================
``GET /health``                           none   ``{"status": "ok", "agent", "running"}``
``POST /run``                             admin  one turn: ``{message, session_key, run_id,
                                                 history, queue_mode, metadata}`` ->
                                                 ``{summary, metadata, events}``; the agent's
                                                 exception -> 500 ``error.message``
``POST /session/{key}/close``             admin  the agent's ``close_session(key)`` if any
========================================  =====  ===========================================

``events`` are what the agent emitted, in order: ``{"type": "delta", "text"}``,
``{"type": "tool_call", "name", "args"}``, ``{"type": "tool_result", "name", "result"}``.
SIGTERM stops it after calling the agent's ``close_all_sessions()`` if it has one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from aiohttp import web

from areal.utils import auth, logging
from areal.utils.dynamic_import import import_from_string
from areal.v2.agent_service.protocol import ADMIN_KEY_ENV, QueueMode
from areal.v2.agent_service.types import AgentRequest, AgentResponse

logger = logging.getLogger("AgentWorker")


class RecordingEmitter:
    """The ``EventEmitter`` of one turn: keeps every event in order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    async def emit_delta(self, text: str) -> None:
        self.events.append({"type": "delta", "text": str(text)})

    async def emit_tool_call(self, name: str, args: str) -> None:
        self.events.append({"type": "tool_call", "name": str(name), "args": str(args)})

    async def emit_tool_result(self, name: str, result: str) -> None:
        self.events.append({"type": "tool_result", "name": str(name), "result": str(result)})


def load_agent(path: str) -> Any:
    """Import ``path`` and return an instance; ``ValueError`` / ``ImportError`` /
    ``TypeError`` say what is wrong with it."""
    obj = import_from_string(path)
    agent = obj() if isinstance(obj, type) else obj
    run = getattr(agent, "run", None)
    if run is None or not inspect.iscoroutinefunction(run):
        raise TypeError(f"agent {path!r} has no 'async def run(request, *, emitter)' method")
    return agent


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def make_app(agent: Any, agent_path: str, admin_key: str) -> web.Application:
    running = {"turns": 0}

    def authorized(request: web.Request) -> bool:
        key = auth.extract_key(request.headers)
        return key is not None and auth.keys_equal(key, admin_key)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "agent": agent_path, **running})

    async def run(request: web.Request) -> web.Response:
        if not authorized(request):
            return _error(401, "unauthorized: the agent service's admin key is required", "auth")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"malformed JSON body: {e}", "invalid_request")
        req = AgentRequest(
            message=str(body.get("message", "")),
            session_key=str(body.get("session_key", "")),
            run_id=str(body.get("run_id", "")),
            history=list(body.get("history") or []),
            queue_mode=QueueMode.parse(body.get("queue_mode", "collect")),
            metadata=dict(body.get("metadata") or {}),
        )
        emitter = RecordingEmitter()
        running["turns"] += 1
        try:
            out = await agent.run(req, emitter=emitter)
        except Exception as e:  # the agent's failure is the answer of this turn
            logger.exception("agent %s failed in session %s", agent_path, req.session_key)
            return _error(500, f"agent {agent_path} failed: {type(e).__name__}: {e}", "agent_error")
        finally:
            running["turns"] -= 1
        if not isinstance(out, AgentResponse):
            return _error(
                500,
                f"agent {agent_path} returned {type(out).__name__}; /v1/responses turns "
                "need an AgentResponse",
                "agent_error",
            )
        answer = {**asdict(out), "events": emitter.events}
        try:
            return web.json_response(answer)
        except TypeError as e:
            return _error(500, f"agent {agent_path}: result is not JSON: {e}", "agent_error")

    async def close_session(request: web.Request) -> web.Response:
        if not authorized(request):
            return _error(401, "unauthorized: the agent service's admin key is required", "auth")
        close = getattr(agent, "close_session", None)
        if close is not None:
            await close(request.match_info["key"])
        return web.json_response({"status": "ok"})

    async def close_all(app: web.Application) -> None:
        close = getattr(agent, "close_all_sessions", None)
        if close is not None:
            try:
                await close()
            except Exception:  # stopping anyway
                logger.exception("agent %s: close_all_sessions failed", agent_path)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_post("/run", run)
    app.router.add_post("/session/{key}/close", close_session)
    app.on_cleanup.append(close_all)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="areal agent-service worker")
    p.add_argument("--agent", required=True, help="agent import path 'pkg.module.Class'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    if os.getcwd() not in sys.path:  # agents named relative to the launch directory
        sys.path.insert(0, os.getcwd())
    try:
        agent = load_agent(args.agent)
    except Exception as e:  # any failure to build the agent ends the worker
        logger.error("cannot load agent %r: %s: %s", args.agent, type(e).__name__, e)
        sys.exit(2)
    key = os.environ.get(ADMIN_KEY_ENV) or auth.DEFAULT_ADMIN_KEY
    logger.info("agent %s loaded; serving on %s:%d", args.agent, args.host, args.port)
    web.run_app(
        make_app(agent, args.agent, key), host=args.host, port=args.port, print=None,
        access_log=None,
    )  # fmt: skip


if __name__ == "__main__":
    main()
