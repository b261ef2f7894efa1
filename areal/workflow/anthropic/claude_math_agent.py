"""AReaL's calculator math agent for the Anthropic API (``...anthropic.claude_math_agent``).

AReaL's ``MathToolAgent`` here drives the Claude Agent SDK (``claude_agent_sdk``, which
runs the Claude Code CLI as a subprocess, with the calculator as an in-process MCP
server). Ours keeps the path, the class name, the constructor (``max_turns`` and sampling
kwargs) and the ``run`` contract, and runs the same tool loop with the Anthropic SDK
against the proxy's ``/v1/messages``: each turn sends the conversation with the
calculator tools; ``tool_use`` blocks are executed
(:func:`~areal.workflow.openai.math_tools.run_tool`) and answered with ``tool_result``
blocks; a reply without tool use ends the episode, whose text is rewarded against
``data["answer"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from areal.api.reward_api import AsyncRewardWrapper
from areal.workflow.anthropic.math_agent import anthropic_client, create_kwargs, reply_text
from areal.workflow.openai.math_tools import (
    DEFAULT_TOOL_NAMES,
    TOOL_SYSTEM_PROMPT,
    TOOLS_BY_NAME,
    check_tool_names,
    math_reward_fn,
    run_tool,
    tool_schema,
)

__all__ = ["MathToolAgent"]


class MathToolAgent:
    """A calculator tool loop on the Anthropic Messages API, at most ``max_turns`` calls.

    ``system_prompt`` (AReaL's by default; ``None``: none) and ``tools`` (calculator tool
    names, all by default) shape the request; other ``kwargs`` (``max_tokens`` (default
    1024), ``temperature``, ...) go to every ``messages.create``. The last user message of
    ``data["messages"]`` is the question.
    """

    SYSTEM_PROMPT = TOOL_SYSTEM_PROMPT

    def __init__(
        self,
        max_turns: int = 10,
        system_prompt: str | None = SYSTEM_PROMPT,
        tools: Sequence[str] = DEFAULT_TOOL_NAMES,
        **kwargs: Any,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}; must be >= 1")
        self.max_turns = int(max_turns)
        self.system_prompt = system_prompt
        self.tools = [tool_schema(TOOLS_BY_NAME[n]) for n in check_tool_names(tools)]
        self.kwargs = dict(kwargs)
        self.kwargs.pop("max_completion_tokens", None)
        self.kwargs.setdefault("max_tokens", 1024)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        client = anthropic_client(extra_kwargs)
        kwargs = create_kwargs(client, self.kwargs)
        if self.system_prompt:
            kwargs["system"] = self.system_prompt
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": data["messages"][-1]["content"]}
        ]
        final_output = ""
        for _ in range(self.max_turns):
            reply = await client.messages.create(
                model="default", messages=messages, tools=self.tools, **kwargs
            )
            final_output = reply_text(reply)
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        b.model_dump(mode="json", exclude_none=True) for b in reply.content
                    ],
                }
            )
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                break
            results = []
            for block in uses:
                text, is_error = run_tool(block.name, block.input)
                results.append(
                    {
                        "type": "tool_result",
                        "tool_use_id": block.id,
                        "content": text,
                        "is_error": is_error,
                    }
                )
            messages.append({"role": "user", "content": results})
        return await AsyncRewardWrapper(math_reward_fn)(
            completions=final_output, answer=data["answer"]
        )
