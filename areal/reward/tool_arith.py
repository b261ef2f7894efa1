"""The necessary-tool task's tool and reward: a one-operation calculator, scored answers.

The task (:mod:`areal.dataset.tool_arith`) asks for ``A * B + C`` with two-digit ``A``,
``B`` and a three-digit ``C``: beyond what the ~1M-parameter ``tiny-tool-mix`` model can
compute in its head. The tool, :func:`step_calculator`, evaluates **one** operation
(``"47 * 86"``, ``"4042 + 315"``), so a correct answer takes two calls over two turns
(product, then sum) and a final answer that copies the second result.

:func:`tool_arith_reward_fn` is 1.0 when the last number of the final answer equals the
true result, else 0.0: a direct guess scores 0 unless it happens to be right.
"""

from __future__ import annotations

import json
import re
from typing import Any

STEP_CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate one operation on two integers: 'a + b', 'a - b' or 'a * b'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. '47 * 86'"}},
            "required": ["expression"],
        },
    },
}

_STEP_RE = re.compile(r"^\s*(-?\d{1,9})\s*([+\-*])\s*(-?\d{1,9})\s*$")
_NUM_RE = re.compile(r"-?\d+")


def step_calculator(expression: str) -> str:
    """``"47 * 86"`` -> ``"4042"``; anything but one ``+ - *`` of two integers -> an error."""
    m = _STEP_RE.match(expression) if isinstance(expression, str) else None
    if m is None:
        return "error: one operation of two integers at a time, e.g. '47 * 86'"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def run_step_call(arguments: str | dict[str, Any]) -> str:
    """The calculator's answer to a call's ``arguments`` (JSON text or dict)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: arguments are not JSON"
    if not isinstance(arguments, dict) or "expression" not in arguments:
        return "error: missing 'expression'"
    return step_calculator(arguments["expression"])


def final_integer(text: str | None) -> int | None:
    """The last integer in ``text``, or None."""
    found = _NUM_RE.findall(text or "")
    return int(found[-1]) if found else None


def true_result(answer: str) -> int:
    """``"... #### 4357"`` (the rows' GSM8K-style answer) -> 4357."""
    return int(answer.rsplit("####", 1)[-1].strip())


def tool_arith_reward_fn(completion: str | None, answer: str | int) -> float:
    """1.0 when the last integer of ``completion`` is the true result, else 0.0."""
    target = true_result(answer) if isinstance(answer, str) else int(answer)
    return float(final_integer(completion) == target)
