"""What an agent implements (``AgentRunnable``) and what it is given and returns.

An agent is any class whose instances have ``async def run(request, *, emitter)``; the
worker builds one instance (no arguments) at start. Per turn it receives an
``AgentRequest``: the new user ``message``, the ``session_key``, and ``history``, the
session's earlier messages in OpenAI chat format (``role`` / ``content``, assistant
``tool_calls`` and ``tool`` results for the tool events it emitted). It reports what it
does through the ``emitter`` (text deltas, tool calls, tool results) and returns an
``AgentResponse`` whose ``summary`` is the assistant's reply of the turn.

``metadata`` carries ``areal_inference`` (``{"base_url", "api_key", "model"}``) when the
client routed the session's model calls through an inference gateway (the turn's
``inf_base_url`` / ``session_api_key`` / ``inf_model``): the agent should call that
OpenAI-compatible base URL with that key, so the calls are recorded for training.

Optional agent methods, called when present: ``async close_session(session_key)``
(the session was closed) and ``async close_all_sessions()`` (the worker stops).
``StreamResponse`` is accepted for import compatibility with AReaL 2.0's agents (its
raw ``/v1/chat/completions`` relay); ``/v1/responses`` needs an ``AgentResponse``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from areal.v2.agent_service.protocol import QueueMode


@dataclass
class AgentRequest:
    """One turn given to the agent (module docstring)."""

    message: str
    session_key: str
    run_id: str
    history: list[dict[str, Any]] = field(default_factory=list)
    queue_mode: QueueMode = QueueMode.COLLECT
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentResponse:
    """The agent's result of one turn: the reply text and JSON-serializable extras."""

    summary: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamResponse:
    """A raw HTTP answer (status, headers, body chunks) an agent may return instead."""

    status_code: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]


class EventEmitter(Protocol):
    """How an agent reports a turn's progress; the worker records every event."""

    async def emit_delta(self, text: str) -> None: ...

    async def emit_tool_call(self, name: str, args: str) -> None: ...

    async def emit_tool_result(self, name: str, result: str) -> None: ...


@runtime_checkable
class AgentRunnable(Protocol):
    """An agent: ``run`` one turn of a session (module docstring)."""

    async def run(
        self, request: AgentRequest, *, emitter: EventEmitter
    ) -> AgentResponse | StreamResponse: ...
