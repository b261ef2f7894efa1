"""The tiny tool-calling model: chat template, calculator tool, and its evaluation.

``tiny-tool`` (``areal/models/assets/tiny-tool``, rebuilt by
``examples/agent_workflow/build_tiny_tool_model.py``) is a ~1M-parameter Qwen2 of the same
shape as ``tiny-base``, trained from scratch on synthetic transcripts in which the assistant
calls a calculator::

    <|im_start|>system
    Tools: calculator<|im_end|>
    <|im_start|>user
    Mia has 31 apples. She buys 45 more apples. ... How many apples does Mia have now?<|im_end|>
    <|im_start|>assistant
    <tool_call>{"name": "calculator", "arguments": {"expression": "31 + 45 - 12"}}</tool_call><|im_end|>
    <|im_start|>tool
    64<|im_end|>
    <|im_start|>assistant
    The answer is 64.<|im_end|>

Its chat template (:data:`TOOL_CHAT_TEMPLATE`) follows Hugging Face conventions: pass
``tools=[CALCULATOR_TOOL]`` to ``apply_chat_template``; assistant messages may carry
OpenAI-style ``tool_calls`` (``arguments`` as a dict or a JSON string); results come back as
``{"role": "tool", "content": ...}`` messages. ``<tool_call>`` and ``</tool_call>`` are
single (non-special) tokens, so decoding with ``skip_special_tokens=True`` keeps them and
the ``qwen``/``hermes`` parser of :mod:`areal.experimental.openai.tool_call_parser` reads
the calls.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Any

from areal.utils import logging

logger = logging.getLogger("TinyToolModel")

_ASSETS = Path(__file__).resolve().parent / "assets"

TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. '31 + 45 - 12'"}},
            "required": ["expression"],
        },
    },
}

# ChatML with tools: a system block names the offered tools; assistant tool calls render as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>; tool results use the `tool` role.
TOOL_CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c -%}{%- for p in c -%}{{ p.text if p.text is defined else '' }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set sys_first = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if sys_first -%}{{ text(messages[0].content) + '\\n' }}{%- endif -%}"
    "{{ 'Tools:' }}"
    "{%- for t in tools -%}"
    "{{ ' ' + (t.function.name if t.function is defined else t.name) }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (loop.first and tools and sys_first) -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + text(m.content) }}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    '{{ \'<tool_call>{"name": "\' + f.name + \'", "arguments": \' }}'
    "{%- if f.arguments is string -%}{{ f.arguments }}{%- else -%}{{ f.arguments | tojson }}{%- endif -%}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def get_tiny_tool_path() -> str:
    """Directory of the shipped tiny tool-calling checkpoint (config, safetensors, tokenizer)."""
    path = _ASSETS / "tiny-tool"
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"tiny tool checkpoint missing at {path}; rebuild it with "
            "`python examples/agent_workflow/build_tiny_tool_model.py`"
        )
    return str(path)


def get_tiny_tool_mix_path() -> str:
    """Directory of ``tiny-tool-mix``: the base of the necessary-tool task
    (``examples/tool_task``; rebuilt by ``examples/tool_task/build_tiny_tool_mix.py``)."""
    path = _ASSETS / "tiny-tool-mix"
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"tiny-tool-mix checkpoint missing at {path}; rebuild it with "
            "`python examples/tool_task/build_tiny_tool_mix.py`"
        )
    return str(path)


# ----------------------------------------------------------------------------- calculator
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_EXPR_CHARS = 200


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval_node(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if abs(left) > 1e12 or abs(right) > 1e12:
            raise ValueError("number too large")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"unsupported element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate ``+ - * /`` arithmetic safely (no names, calls or powers).

    Returns the result as text (an integer when whole, e.g. ``"64"``) or ``"error: ..."``
    for anything else, as a tool would answer a model.
    """
    if not isinstance(expression, str) or len(expression) > _MAX_EXPR_CHARS:
        return "error: expression must be a string of at most 200 characters"
    try:
        value = _eval_node(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def run_calculator_call(arguments: str | dict[str, Any]) -> str:
    """The calculator's answer to a call's ``arguments`` (JSON text or dict)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: arguments are not JSON"
    if not isinstance(arguments, dict) or "expression" not in arguments:
        return "error: missing 'expression'"
    return calculator(arguments["expression"])


_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in ``text`` (the answer the tiny model gives), or None."""
    found = _NUM_RE.findall(text or "")
    return found[-1] if found else None


def tool_answer_reward_fn(completion: str, answer: Any) -> float:
    """1.0 when the last number of ``completion`` equals ``answer`` (int-compared), else 0."""
    got = final_number(completion)
    if got is None:
        return 0.0
    try:
        return float(float(got) == float(answer))
    except (TypeError, ValueError):
        return 0.0
