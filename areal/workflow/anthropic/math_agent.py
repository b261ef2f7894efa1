"""AReaL's single-call math agent on the Anthropic SDK (``areal.workflow.anthropic.math_agent``).

:class:`MathAgent` sends ``data["messages"]`` (a leading ``system`` message becomes the
``system`` argument) to the proxy's ``/v1/messages`` with ``anthropic.AsyncAnthropic``
(``base_url`` / ``api_key`` / ``http_client`` from ``extra_kwargs``, else
``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``) and returns the reward of the reply's text
against ``data["answer"]``. The proxy records the call token-exactly, like a Chat
Completions call.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import anthropic

from areal.api.reward_api import AsyncRewardWrapper
from areal.workflow.openai.math_tools import math_reward_fn

__all__ = ["MathAgent", "anthropic_client", "create_kwargs", "reply_text"]


def anthropic_client(extra_kwargs: dict[str, Any]) -> anthropic.AsyncAnthropic:
    """The proxy's Anthropic client for one episode (``extra_kwargs``, else the environment)."""
    return anthropic.AsyncAnthropic(
        base_url=extra_kwargs.get("base_url") or os.getenv("ANTHROPIC_BASE_URL"),
        api_key=extra_kwargs.get("api_key") or os.getenv("ANTHROPIC_API_KEY"),
        http_client=extra_kwargs.get("http_client"),
        max_retries=0,
    )


def create_kwargs(client: anthropic.AsyncAnthropic, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``messages.create`` arguments from sampling kwargs: the ones this SDK version has no
    parameter for (``temperature``, ``top_p`` in some) travel in ``extra_body``."""
    known = set(inspect.signature(client.messages.create).parameters)
    out = {k: v for k, v in kwargs.items() if k in known}
    extra = {k: v for k, v in kwargs.items() if k not in known}
    if extra:
        out["extra_body"] = {**(out.get("extra_body") or {}), **extra}
    return out


def reply_text(message: Any) -> str:
    """The concatenated text blocks of an Anthropic ``Message``."""
    return "".join(b.text for b in message.content if b.type == "text")


class MathAgent:
    """One Anthropic Messages call; ``kwargs`` (``max_tokens``, ``temperature``, ...) go to
    ``messages.create`` (``max_completion_tokens`` and ``max_turns`` are dropped: AReaL's
    workflow kwargs carry them for other agents; ``max_tokens`` defaults to 1024)."""

    def __init__(self, **kwargs: Any):
        self.kwargs = dict(kwargs)
        self.kwargs.pop("max_completion_tokens", None)
        self.kwargs.pop("max_turns", None)
        self.kwargs.setdefault("max_tokens", 1024)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        client = anthropic_client(extra_kwargs)
        system = None
        messages = []
        for msg in data["messages"]:
            if msg["role"] == "system":
                system = msg["content"]
            else:
                messages.append({"role": msg["role"], "content": msg["content"]})
        kwargs = create_kwargs(client, self.kwargs)
        if system:
            kwargs["system"] = system
        reply = await client.messages.create(model="default", messages=messages, **kwargs)
        return await AsyncRewardWrapper(math_reward_fn)(
            completions=reply_text(reply), answer=data["answer"]
        )
