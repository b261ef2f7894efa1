"""AReaL's LangChain math agents (``areal.workflow.langchain.math_agent``).

Both point LangChain's ``ChatOpenAI`` at the proxy (``base_url`` / ``api_key`` /
``http_client`` from ``extra_kwargs``, else ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``);
sampling comes from the constructor kwargs AReaL's ``workflow_kwargs`` carry
(``temperature``, ``top_p``, ``max_completion_tokens`` as the output limit, default 1024).

- :class:`MathAgent`: one ``ainvoke`` on ``data["messages"]``; returns its reward.
- :class:`MathToolAgent`: LangChain's ``create_agent`` (a LangGraph tool loop) with the
  calculator tools as LangChain tools; returns the reward of the last message.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from langchain.agents import create_agent
from langchain.tools import tool
from langchain_openai import ChatOpenAI

from areal.api.reward_api import AsyncRewardWrapper
from areal.workflow.openai.math_tools import (
    CALCULATOR_FUNCTIONS,
    DEFAULT_TOOL_NAMES,
    check_tool_names,
    math_reward_fn,
)

__all__ = ["CALCULATOR_TOOLS", "MathAgent", "MathToolAgent", "chat_model"]

# the calculator functions as LangChain tools
CALCULATOR_TOOLS = {fn.__name__: tool(fn) for fn in CALCULATOR_FUNCTIONS}

SYSTEM_PROMPT = (
    "You are a math assistant with calculator tools. Use the tools for every calculation "
    "instead of calculating in your head, reason step by step, and finish with the final "
    "answer."
)


def chat_model(kwargs: dict[str, Any], extra_kwargs: dict[str, Any]) -> ChatOpenAI:
    """``ChatOpenAI`` on the proxy for one episode."""
    return ChatOpenAI(
        model="default",
        base_url=extra_kwargs.get("base_url") or os.getenv("OPENAI_BASE_URL"),
        api_key=extra_kwargs.get("api_key") or os.getenv("OPENAI_API_KEY"),
        temperature=kwargs.get("temperature", 1.0),
        top_p=kwargs.get("top_p", 1.0),
        max_tokens=kwargs.get("max_completion_tokens", 1024),
        http_async_client=extra_kwargs.get("http_client"),
        max_retries=0,
    )


class MathAgent:
    """One ``ChatOpenAI.ainvoke`` on ``data["messages"]``, rewarded against ``data["answer"]``."""

    def __init__(self, **kwargs: Any):
        self.kwargs = dict(kwargs)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        response = await chat_model(self.kwargs, extra_kwargs).ainvoke(data["messages"])
        return await AsyncRewardWrapper(math_reward_fn)(
            completions=response.content or "", answer=data["answer"]
        )


class MathToolAgent:
    """``create_agent`` with the calculator tools on the proxy's chat model.

    ``system_prompt`` (ours by default; ``None``: none) and ``tools`` (calculator tool
    names, all by default) shape the agent; the last user message of ``data["messages"]``
    is the question. The graph calls the model until it answers without a tool call.
    """

    def __init__(
        self,
        system_prompt: str | None = SYSTEM_PROMPT,
        tools: Sequence[str] = DEFAULT_TOOL_NAMES,
        **kwargs: Any,
    ):
        self.system_prompt = system_prompt
        self.tool_names = check_tool_names(tools)  # names: the agent stays picklable
        self.kwargs = dict(kwargs)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        agent = create_agent(
            model=chat_model(self.kwargs, extra_kwargs),
            tools=[CALCULATOR_TOOLS[n] for n in self.tool_names],
            system_prompt=self.system_prompt,
        )
        question = data["messages"][-1]["content"]
        result = await agent.ainvoke({"messages": [{"role": "user", "content": question}]})
        final = result["messages"][-1]
        return await AsyncRewardWrapper(math_reward_fn)(
            completions=str(final.content or ""), answer=data["answer"]
        )
