"""OpenAI-compatible access to an ``InferenceEngine`` with token-level recording for RL.

- :class:`ArealOpenAI` (``client.py``): an ``openai.AsyncOpenAI`` whose
  ``chat.completions.create`` and ``responses.create`` are served by ``engine.agenerate``.
- :class:`InteractionCache` (``cache.py``) and :class:`InteractionWithTokenLogpReward`
  (``types.py``): what every call records, rewards, export.
- ``tool_call_parser.py``: ``<tool_call>`` JSON and ``<think>`` parsing.
- ``proxy/``: the OpenAI-compatible HTTP proxy for agent programs (:class:`ProxyServer`,
  :class:`OpenAIProxyClient`, :class:`OpenAIProxyWorkflow`).

Names resolve lazily, so that the parser is importable without the ``openai`` SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArealOpenAI": "areal.experimental.openai.client",
    "InteractionCache": "areal.experimental.openai.cache",
    "InteractionWithTokenLogpReward": "areal.experimental.openai.types",
    "process_tool_calls": "areal.experimental.openai.tool_call_parser",
    "parse_tool_calls": "areal.experimental.openai.tool_call_parser",
    "parse_reasoning": "areal.experimental.openai.tool_call_parser",
    # the proxy for agent programs (proxy/)
    "OpenAIProxyWorkflow": "areal.experimental.openai.proxy.workflow",
    "OpenAIProxyClient": "areal.experimental.openai.proxy.client_session",
    "ProxyServer": "areal.experimental.openai.proxy.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
