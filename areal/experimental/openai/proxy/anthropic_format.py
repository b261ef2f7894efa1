"""Anthropic Messages API <-> OpenAI Chat Completions translation for the proxy.

The proxy serves ``POST /v1/messages`` by translating the request into Chat Completions
arguments, running it through the same recorded path as ``/chat/completions`` (so the
interaction is cached token-exactly), and translating the ``ChatCompletion`` back into
an Anthropic ``Message`` (or its SSE event stream). The message id is the completion id,
so ``/rl/set_reward`` accepts the id the Anthropic client sees.

Supported: ``system`` (string or text blocks), text / ``tool_use`` / ``tool_result``
content blocks, ``tools`` (``input_schema``), ``tool_choice`` (auto/any/tool/none),
``max_tokens``, ``temperature``, ``top_p``, ``stop_sequences``, ``metadata``,
``stream``. Other block types (images, documents) are rejected with a ``ValueError``
(the proxy answers 400).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


def _block_text(content: Any, where: str) -> str:
    """Text of a string or a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of blocks")
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"{where}: unsupported content block type {kind!r}")
    return "".join(parts)


def _convert_message(i: int, msg: Any) -> list[dict[str, Any]]:
    if not isinstance(msg, dict):
        raise ValueError(f"messages[{i}] must be an object")
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise ValueError(f"messages[{i}].role={role!r}; allowed: 'user', 'assistant'")
    content = msg.get("content")
    if isinstance(content, str) or content is None:
        return [{"role": role, "content": content or ""}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of blocks")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(block, dict):
            raise ValueError(f"{where} must be an object")
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            tool_calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input", {})),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id", "")),
                    "content": _block_text(block.get("content"), where),
                }
            )
        else:
            raise ValueError(f"{where}: unsupported block type {kind!r} in a {role} message")
    if role == "assistant":
        msg_out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if tool_calls:
            msg_out["tool_calls"] = tool_calls
        out.append(msg_out)
    elif texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _convert_tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    if not isinstance(choice, dict):
        raise ValueError("tool_choice must be an object")
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": str(choice.get("name", ""))}}
    raise ValueError(f"tool_choice.type={kind!r}; allowed: auto, any, tool, none")


def anthropic_to_openai(req: dict[str, Any]) -> dict[str, Any]:
    """Chat Completions ``create`` arguments for an Anthropic Messages request body."""
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out_msgs: list[dict[str, Any]] = []
    system = req.get("system")
    if system:
        out_msgs.append({"role": "system", "content": _block_text(system, "system")})
    for i, m in enumerate(messages):
        out_msgs += _convert_message(i, m)
    args: dict[str, Any] = {"messages": out_msgs, "max_tokens": int(req["max_tokens"])}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("metadata", None)):
        if req.get(src) is not None and dst is not None:
            args[dst] = req[src]
    if req.get("stop_sequences"):
        args["stop"] = list(req["stop_sequences"])
    tools = req.get("tools")
    if tools:
        converted = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or "name" not in t:
                raise ValueError(f"tools[{k}] must be an object with a name")
            fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
            if t.get("description"):
                fn["description"] = t["description"]
            converted.append({"type": "function", "function": fn})
        args["tools"] = converted
    choice = _convert_tool_choice(req.get("tool_choice"))
    if choice is not None:
        args["tool_choice"] = choice
    if "model" in req:
        args["model"] = req["model"]
    return args


def _stop_reason(finish_reason: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "end_turn"


def openai_to_anthropic(completion: Any, model: str) -> dict[str, Any]:
    """An Anthropic ``Message`` (as a dict) for a ``ChatCompletion``; id = completion id."""
    choice = completion.choices[0]
    msg = choice.message
    content: list[dict[str, Any]] = []
    if msg.content or not msg.tool_calls:
        content.append({"type": "text", "text": msg.content or ""})
    for tc in msg.tool_calls or []:
        try:
            args = json.loads(tc.function.arguments or "{}")
        except json.JSONDecodeError:
            args = {"_raw": tc.function.arguments}
        content.append({"type": "tool_use", "id": tc.id, "name": tc.function.name, "input": args})
    usage = completion.usage
    return {
        "id": completion.id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(choice.finish_reason),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.prompt_tokens if usage else 0,
            "output_tokens": usage.completion_tokens if usage else 0,
        },
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def anthropic_sse(message: dict[str, Any]) -> AsyncIterator[str]:
    """The Anthropic streaming events of a finished message (one delta per block)."""
    head = dict(message, content=[], stop_reason=None)
    head["usage"] = {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}
    yield _event("message_start", {"type": "message_start", "message": head})
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": i, "content_block": start},
        )
        yield _event(
            "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": i})
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})
