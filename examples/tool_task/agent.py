"""The necessary-tool task's agent: an OpenAI-SDK tool loop, one model call per turn.

Each episode asks ``A * B + C`` (:mod:`areal.dataset.tool_arith`) with the one-operation
calculator offered (:data:`areal.reward.tool_arith.STEP_CALCULATOR_TOOL`). Every reply that
calls the tool is answered with a ``tool`` message and the model is called again (at most
``max_calls`` calls); a reply without a call is the final answer. The reward is 1.0 when
that answer is the true result (:func:`areal.reward.tool_arith.tool_arith_reward_fn`).
Through the proxy every call becomes one training row (``export_style: individual``) whose
prompt holds the earlier turns and tool results, so only the model's own tokens are
trained on; the episode's reward reaches every call (``turn_discount: 1.0``).
"""

from __future__ import annotations

from typing import Any

from areal.reward.tool_arith import (
    STEP_CALCULATOR_TOOL,
    run_step_call,
    tool_arith_reward_fn,
    true_result,
)


class ToolArithAgent:
    """``run(data, **extra_kwargs)`` -> reward; ``record=True`` keeps one dict per episode
    (``success``, ``tool_called``, ``model_calls``, ``question``, ``target``) for the
    evaluation. ``use_tool=False`` disables the tool: a reply that calls it ends the
    episode unanswered (reward 0), so only a direct answer can score."""

    def __init__(
        self,
        max_tokens: int = 32,
        temperature: float = 1.0,
        max_calls: int = 3,
        record: bool = False,
        use_tool: bool = True,
    ):
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_calls = max_calls
        self.record = record
        self.use_tool = use_tool
        self.records: list[dict[str, Any]] = []

    async def run(self, data: dict, **extra_kwargs) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs.get("http_client"),
        )
        messages: list[dict[str, Any]] = [dict(m) for m in data["messages"]]
        final, called, n_calls = "", False, 0
        for _ in range(self.max_calls):
            reply = await client.chat.completions.create(
                model="default",
                messages=messages,
                tools=[STEP_CALCULATOR_TOOL],
                max_tokens=self.max_tokens,
                temperature=self.temperature,
            )
            n_calls += 1
            msg = reply.choices[0].message
            if not msg.tool_calls:
                final = msg.content or ""
                break
            called = True
            if not self.use_tool:
                break  # the tool is disabled: a call ends the episode unanswered
            tc = msg.tool_calls[0]
            messages.append(
                {
                    "role": "assistant",
                    "content": msg.content or "",
                    "tool_calls": [
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {
                                "name": tc.function.name,
                                "arguments": tc.function.arguments,
                            },
                        }
                    ],
                }
            )
            messages.append(
                {
                    "role": "tool",
                    "content": run_step_call(tc.function.arguments),
                    "tool_call_id": tc.id,
                }
            )
        reward = tool_arith_reward_fn(final, data["answer"])
        if self.record:
            self.records.append(
                {
                    "success": reward == 1.0,
                    "tool_called": called,
                    "model_calls": n_calls,
                    "question": messages[0]["content"],
                    "target": true_result(data["answer"]),
                }
            )
        return reward


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Rates over episodes: success, tool use, mean model calls."""
    n = max(1, len(records))
    return {
        "n": len(records),
        "success": sum(r["success"] for r in records) / n,
        "tool_called": sum(r["tool_called"] for r in records) / n,
        "model_calls": sum(r["model_calls"] for r in records) / n,
    }
