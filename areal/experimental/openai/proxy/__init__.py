"""OpenAI-compatible proxy for agent programs (AReaL's ``areal.experimental.openai.proxy``).

- ``state.py``: request models, sessions, online grants (:class:`ProxyState`), the
  serialized interactions;
- ``routes.py``: the FastAPI app, its handlers grouped by route family (session API,
  online-mode grants, Chat Completions and Responses, Anthropic Messages);
- ``server.py``: :class:`ProxyServer` (uvicorn in a thread) and the endpoint table.
- ``__main__.py``: ``python -m areal.experimental.openai.proxy``, the proxy as its own
  process in front of running inference servers.
- ``gateway/``: the gateway in front of several proxy workers (session-affine routing,
  ``rollout.agent.proxy_workers``).
- ``client_session.py``: :class:`OpenAIProxyClient`, the session lifecycle over HTTP.
- ``workflow.py``: :class:`OpenAIProxyWorkflow`, which runs an agent's
  ``async run(data, **extra_kwargs)`` as a rollout episode (modes inline / subproc /
  online).

Names resolve lazily (FastAPI and uvicorn are imported only when a server is built).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProxyServer": "areal.experimental.openai.proxy.server",
    "ProxyState": "areal.experimental.openai.proxy.state",
    "create_app": "areal.experimental.openai.proxy.routes",
    "serialize_interactions": "areal.experimental.openai.proxy.state",
    "deserialize_interactions": "areal.experimental.openai.proxy.state",
    "DEFAULT_ADMIN_API_KEY": "areal.experimental.openai.proxy.state",
    "OpenAIProxyClient": "areal.experimental.openai.proxy.client_session",
    "OpenAIProxyWorkflow": "areal.experimental.openai.proxy.workflow",
    "is_agent": "areal.experimental.openai.proxy.workflow",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
