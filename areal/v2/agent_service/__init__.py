"""The agent service: whole agent sessions (multi-turn, tools, memory) behind HTTP.

AReaL 2.0's ``areal.v2.agent_service``, re-implemented. A client posts one user message
per turn to the gateway's ``POST /v1/responses`` (admin key, ``user`` = session key);
the gateway keeps each session's conversation, pins the session to one agent worker,
and replays the conversation to the agent on every turn. A worker imports the agent
class (``AgentConfig.agent_cls_path``) and calls its ``run(request, emitter=...)``.

Modules: ``types`` (what agents implement and receive), ``protocol`` (shared enums),
``gateway`` (the gateway process: auth, session routing, history), ``worker`` (the
agent worker process), ``controller`` (``AgentController``: starts and scales them
through a scheduler). docs/areal_compat.md ("The agent service") lists the routes.
"""

from areal.v2.agent_service.types import (
    AgentRequest,
    AgentResponse,
    AgentRunnable,
    EventEmitter,
    StreamResponse,
)

__all__ = ["AgentRequest", "AgentResponse", "AgentRunnable", "EventEmitter", "StreamResponse"]
