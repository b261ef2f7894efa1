"""Parse tool calls and reasoning out of generated text (no inference backend needed).

Formats
-------
- Tool calls, parsers ``qwen`` / ``qwen25`` / ``hermes`` (one format, three names): each call
  is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (whitespace around the
  JSON allowed; ``"parameters"`` accepted for ``"arguments"``; ``arguments`` may be an
  object or a JSON string). Text outside the blocks is the message content.
- Reasoning, parsers ``qwen3`` / ``deepseek_r1`` (``deepseek-r1``): ``<think>...</think>``.
  With ``deepseek_r1`` the opening tag may sit in the prompt, so text before a lone
  ``</think>`` is reasoning too.

A block whose JSON does not parse, or that names a tool not offered in ``tools``, is not a
call: it stays in the content and is logged, so a malformed call is visible to the reward
function instead of disappearing.

:func:`process_tool_calls` keeps AReaL's signature and returns OpenAI-typed calls
(``ChatCompletionMessageFunctionToolCall``, or ``ResponseFunctionToolCall`` for the
Responses API); :func:`parse_tool_calls` and :func:`parse_reasoning` are the plain parsers.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from areal.utils import logging

logger = logging.getLogger("ToolCallParser")

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"

TOOL_CALL_PARSERS = ("qwen", "qwen25", "hermes")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "deepseek-r1")

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.S)


@dataclass
class ParsedToolCall:
    """One parsed call: the tool ``name`` and its ``arguments`` as a JSON object string."""

    name: str
    arguments: str

    def arguments_dict(self) -> dict[str, Any]:
        return json.loads(self.arguments)


def _check_name(kind: str, name: str, allowed: tuple[str, ...]) -> None:
    if name not in allowed:
        raise ValueError(f"{kind}={name!r} is not supported; allowed: {list(allowed)}")


def _tool_names(tools: list[Any] | None) -> set[str] | None:
    """Names offered in Chat Completions (``{"type": "function", "function": {...}}``) or
    Responses (``{"type": "function", "name": ...}``) tool lists; None = accept any."""
    if tools is None:
        return None
    names = set()
    for t in tools:
        if hasattr(t, "model_dump"):
            t = t.model_dump()
        if not isinstance(t, dict):
            continue
        fn = t.get("function")
        name = fn.get("name") if isinstance(fn, dict) else t.get("name")
        if name:
            names.add(str(name))
    return names


def _parse_block(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_calls(
    text: str, tool_call_parser: str = "qwen", tools: list[Any] | None = None
) -> tuple[str, list[ParsedToolCall]]:
    """Split ``text`` into (content without the parsed call blocks, calls in order).

    ``tools``: if given, calls to names not in it are left in the content (logged).
    """
    _check_name("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS)
    allowed = _tool_names(tools)
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK_RE.finditer(text):
        call = _parse_block(m.group(1))
        if call is not None and allowed is not None and call.name not in allowed:
            logger.warning("tool call to %r, which is not among the offered tools", call.name)
            call = None
        elif call is None:
            logger.warning("unparsable tool call block: %r", m.group(0)[:200])
        kept.append(text[pos : m.start()])
        if call is None:
            kept.append(m.group(0))
        else:
            calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept)
    if calls:
        content = content.strip()
    return content, calls


def parse_reasoning(text: str, reasoning_parser: str = "qwen3") -> tuple[str | None, str]:
    """Split ``text`` into (reasoning without the tags or None, the rest).

    A ``<think>`` without ``</think>`` (truncated generation) is all reasoning.
    """
    _check_name("reasoning_parser", reasoning_parser, REASONING_PARSERS)
    start = text.find(THINK_START)
    end = text.find(THINK_END)
    if start == -1:
        if end != -1 and reasoning_parser != "qwen3":  # deepseek_r1: opening tag in the prompt
            return text[:end].strip(), text[end + len(THINK_END) :].lstrip()
        return None, text
    body_start = start + len(THINK_START)
    end = text.find(THINK_END, body_start)
    if end == -1:
        return text[body_start:].strip(), text[:start]
    reasoning = text[body_start:end].strip()
    rest = text[:start] + text[end + len(THINK_END) :].lstrip()
    return reasoning, rest


def process_tool_calls(
    text: str,
    tools: list[Any],
    tool_call_parser: str,
    reasoning_parser: str,
    finish_reason: str,
    use_responses: bool = False,
    tokenizer: Any = None,
) -> tuple[list[Any] | None, str, str]:
    """(OpenAI-typed tool calls or None, remaining text, finish reason).

    The reasoning block (if any) is kept at the head of the remaining text, so that the
    returned message renders back to what the model produced. ``finish_reason`` becomes
    ``"tool_calls"`` when a call was parsed from a generation that stopped normally.
    ``tokenizer`` is accepted for signature compatibility and unused.
    """
    del tokenizer
    reasoning, _ = parse_reasoning(text, reasoning_parser)
    cut = 0
    if reasoning is not None:
        end = text.find(THINK_END)
        cut = len(text) if end == -1 else end + len(THINK_END)
    head, rest = text[:cut], text[cut:]
    content, calls = parse_tool_calls(rest, tool_call_parser, tools)
    if not calls:
        return None, text, finish_reason
    if finish_reason == "stop":
        finish_reason = "tool_calls"
    if use_responses:
        from openai.types.responses.response_function_tool_call import ResponseFunctionToolCall

        typed: list[Any] = [
            ResponseFunctionToolCall(
                type="function_call",
                id=f"fc_{uuid.uuid4().hex[:24]}",
                call_id=f"call_{uuid.uuid4().hex[:24]}",
                name=c.name,
                arguments=c.arguments,
                status="completed",
            )
            for c in calls
        ]
    else:
        from openai.types.chat.chat_completion_message_function_tool_call import (
            ChatCompletionMessageFunctionToolCall,
            Function,
        )

        typed = [
            ChatCompletionMessageFunctionToolCall(
                type="function",
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=Function(name=c.name, arguments=c.arguments),
            )
            for c in calls
        ]
    return typed, head + content, finish_reason
