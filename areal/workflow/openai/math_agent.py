"""AReaL's example math agents on the OpenAI SDK (``areal.workflow.openai.math_agent``).

Each is an *agent* (``async run(data, **extra_kwargs)``): the trainer runs it through the
proxy (:class:`~areal.experimental.openai.proxy.OpenAIProxyWorkflow`), which passes
``base_url``, ``api_key`` and ``http_client`` in ``extra_kwargs``; without them the agent
reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (the ``subproc`` mode sets them). ``data``
holds ``messages`` (chat messages) and ``answer``. Constructor keyword arguments are the
sampling arguments of every call (AReaL's ``workflow_kwargs``: ``temperature``,
``top_p``, ``max_completion_tokens``, ...).

- :class:`MathAgent`: one Chat Completions call; returns its reward (a float).
- :class:`MultiTurnMathAgent`: asks again after a wrong answer, up to ``max_turns``
  calls; returns ``{completion id: reward}``.
- :class:`MathToolAgent`: an ``openai-agents`` ``Agent`` with the calculator function
  tools (:mod:`areal.workflow.openai.math_tools`), run by the ``Runner`` over Chat
  Completions; returns the reward of its final output.

Rewards: :func:`~areal.workflow.openai.math_tools.math_reward_fn` in
:class:`~areal.api.reward_api.AsyncRewardWrapper` (a worker process).
"""

from __future__ import annotations

import os
from typing import Any

import agents
from openai import AsyncOpenAI

from areal.api.reward_api import AsyncRewardWrapper
from areal.workflow.openai.math_tools import (
    CALCULATOR_FUNCTIONS,
    DEFAULT_TOOL_NAMES,
    RETRY_PROMPT,
    TOOL_SYSTEM_PROMPT,
    check_tool_names,
    math_reward_fn,
)

__all__ = ["MathAgent", "MathToolAgent", "MultiTurnMathAgent", "math_reward_fn"]

# the calculator functions as openai-agents function tools
CALCULATOR_TOOLS = {fn.__name__: agents.function_tool(fn) for fn in CALCULATOR_FUNCTIONS}


def openai_client(extra_kwargs: dict[str, Any]) -> AsyncOpenAI:
    """The proxy's OpenAI client for one episode (``extra_kwargs``, else the environment)."""
    return AsyncOpenAI(
        base_url=extra_kwargs.get("base_url") or os.getenv("OPENAI_BASE_URL"),
        api_key=extra_kwargs.get("api_key") or os.getenv("OPENAI_API_KEY"),
        http_client=extra_kwargs.get("http_client"),
        max_retries=0,
    )


class MathAgent:
    """One Chat Completions call on ``data["messages"]``, rewarded against ``data["answer"]``.

    ``kwargs`` go to ``chat.completions.create`` (``max_tokens`` and ``max_turns`` are
    dropped: AReaL's workflow kwargs carry both, ``max_completion_tokens`` is the limit).
    """

    def __init__(self, **kwargs: Any):
        self.kwargs = dict(kwargs)
        self.kwargs.pop("max_tokens", None)
        self.kwargs.pop("max_turns", None)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        client = openai_client(extra_kwargs)
        comp = await client.chat.completions.create(
            messages=data["messages"], model="default", **self.kwargs
        )
        return await AsyncRewardWrapper(math_reward_fn)(
            completions=comp.choices[0].message.content, answer=data["answer"]
        )


class MultiTurnMathAgent:
    """Answer, and after a wrong answer ask again, up to ``max_turns`` calls.

    Every call is rewarded on its own answer; ``run`` returns ``{completion id: reward}``
    (the proxy sets each call's reward). Stops at the first correct answer.
    """

    def __init__(self, max_turns: int = 8, **kwargs: Any):
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}; must be >= 1")
        self.max_turns = int(max_turns)
        self.kwargs = dict(kwargs)
        self.kwargs.pop("max_tokens", None)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> dict[str, float]:
        client = openai_client(extra_kwargs)
        messages = list(data["messages"])
        rewards: dict[str, float] = {}
        for _ in range(self.max_turns):
            comp = await client.chat.completions.create(
                messages=messages, model="default", **self.kwargs
            )
            message = comp.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            reward = await AsyncRewardWrapper(math_reward_fn)(
                completions=message.content, answer=data["answer"]
            )
            rewards[comp.id] = reward
            if reward == 1:
                break
            messages.append({"role": "user", "content": RETRY_PROMPT})
        return rewards


def model_settings(kwargs: dict[str, Any]) -> agents.ModelSettings:
    """``ModelSettings`` from AReaL-style sampling kwargs (``max_completion_tokens`` is the
    output limit; names ``ModelSettings`` lacks go to ``extra_args``)."""
    kwargs = dict(kwargs)
    if "max_completion_tokens" in kwargs:
        kwargs["max_tokens"] = kwargs.pop("max_completion_tokens")
    known = set(agents.ModelSettings.__dataclass_fields__)
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    if extra:
        kwargs["extra_args"] = {**(kwargs.get("extra_args") or {}), **extra}
    return agents.ModelSettings(**kwargs)


class MathToolAgent:
    """An ``openai-agents`` ``Agent`` with the calculator tools, run by the ``Runner``.

    ``max_turns`` (default 10) bounds the Runner's model calls; ``instructions`` is the
    agent's system prompt (AReaL's by default; ``None``: none, as for the tiny tool model,
    which was trained without one); ``tools`` names the calculator tools offered (all by
    default); the other ``kwargs`` are the model settings. The last user message of
    ``data["messages"]`` is the input.
    """

    def __init__(
        self,
        max_turns: int = 10,
        instructions: str | None = TOOL_SYSTEM_PROMPT,
        tools: tuple[str, ...] | list[str] = DEFAULT_TOOL_NAMES,
        **kwargs: Any,
    ):
        self.max_turns = int(max_turns)
        self.instructions = instructions
        self.tool_names = check_tool_names(tools)  # names: the agent stays picklable
        self.kwargs = dict(kwargs)
        self.kwargs.pop("max_tokens", None)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        client = openai_client(extra_kwargs)
        run_config = agents.RunConfig(
            model_provider=agents.OpenAIProvider(openai_client=client, use_responses=False),
            model="default",
            tracing_disabled=True,
            model_settings=model_settings(self.kwargs),
        )
        agent = agents.Agent(
            name="RLVR Math with Calculator",
            instructions=self.instructions,
            tools=[CALCULATOR_TOOLS[n] for n in self.tool_names],
        )
        result = await agents.Runner.run(
            agent,
            input=data["messages"][-1]["content"],
            run_config=run_config,
            max_turns=self.max_turns,
        )
        return await AsyncRewardWrapper(math_reward_fn)(
            completions=result.final_output, answer=data["answer"]
        )
