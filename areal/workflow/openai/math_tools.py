"""The calculator tools and the math reward that the example agents share (no SDK imports).

AReaL's example agents offer six arithmetic tools (``add``, ``subtract``, ``multiply``,
``divide``, ``power``, ``sqrt``). Ours offer the same six plus ``calculator(expression)``,
the tool the shipped tiny tool model (:mod:`areal.models.tiny_tool`) was trained to call,
so that the agents run end to end on it. Each agent module wraps these plain functions
in its SDK's tool type (``agents.function_tool``, ``langchain.tools.tool``, Anthropic
tool schemas). A tool agent's ``tools`` argument selects some of them by name (the tiny
tool model answers well only when offered ``calculator`` alone, as it was trained).

:data:`TOOL_CALLS` counts, per tool name, how often a tool ran in this process (what an
agent's tool use looks like from the outside; tests read it).
"""

from __future__ import annotations

import inspect
import math
import typing
from collections import Counter
from collections.abc import Callable
from typing import Any

from areal.models.tiny_tool import calculator as _evaluate_expression
from areal.reward import get_math_verify_worker

TOOL_CALLS: Counter[str] = Counter()

TOOL_SYSTEM_PROMPT = (
    "Answer the user's math questions using the available calculator tools. "
    "Don't give the answer directly, you must use tools to do the mathematical calculation."
)

RETRY_PROMPT = (
    "Your answer is either wrong or not parsable to the reward function. You may "
    "misunderstand the original question. Please carefully read the original question, "
    "check the previous errors, and try to answer it again."
)


def math_reward_fn(completions: str | None, answer: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to ``answer``, else 0.0."""
    if not completions:
        return 0.0
    return get_math_verify_worker().verify(str(completions), str(answer))


def add(a: float, b: float) -> float:
    """Add two numbers."""
    TOOL_CALLS["add"] += 1
    return a + b


def subtract(a: float, b: float) -> float:
    """Subtract the second number from the first."""
    TOOL_CALLS["subtract"] += 1
    return a - b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    TOOL_CALLS["multiply"] += 1
    return a * b


def divide(a: float, b: float) -> float:
    """Divide the first number by the second."""
    TOOL_CALLS["divide"] += 1
    if b == 0:
        raise ValueError("Division by zero is not allowed.")
    return a / b


def power(base: float, exponent: float) -> float:
    """Raise base to the power of exponent."""
    TOOL_CALLS["power"] += 1
    return base**exponent


def sqrt(n: float) -> float:
    """Calculate the square root of a non-negative number."""
    TOOL_CALLS["sqrt"] += 1
    if n < 0:
        raise ValueError("Cannot compute square root of a negative number.")
    return math.sqrt(n)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    TOOL_CALLS["calculator"] += 1
    return _evaluate_expression(expression)


CALCULATOR_FUNCTIONS: list[Callable[..., Any]] = [
    add,
    subtract,
    multiply,
    divide,
    power,
    sqrt,
    calculator,
]
TOOLS_BY_NAME: dict[str, Callable[..., Any]] = {fn.__name__: fn for fn in CALCULATOR_FUNCTIONS}
# what a tool agent offers unless told otherwise: all of them
DEFAULT_TOOL_NAMES: tuple[str, ...] = tuple(TOOLS_BY_NAME)


def check_tool_names(names: Any) -> tuple[str, ...]:
    """``names`` as a tuple of known tool names; ``ValueError`` naming an unknown one."""
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    unknown = [n for n in names if n not in TOOLS_BY_NAME]
    if not names or unknown:
        raise ValueError(
            f"tools={list(names)}; allowed: a non-empty subset of {list(TOOLS_BY_NAME)}"
        )
    return names


_JSON_TYPES = {float: "number", int: "integer", str: "string"}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``{name, description, input_schema}`` of a tool function (its signature and docstring),
    the shape of an Anthropic ``tools`` entry."""
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    return {
        "name": fn.__name__,
        "description": inspect.getdoc(fn) or fn.__name__,
        "input_schema": {
            "type": "object",
            "properties": {p: {"type": _JSON_TYPES[hints[p]]} for p in params},
            "required": list(params),
        },
    }


def run_tool(name: str, arguments: Any) -> tuple[str, bool]:
    """Run the tool ``name`` on a model's ``arguments`` (a dict): ``(result text, is_error)``.

    An unknown tool, arguments that do not fit, or an error the tool raises become an
    error text for the model, not an exception.
    """
    fn = TOOLS_BY_NAME.get(name)
    if fn is None:
        return f"error: unknown tool {name!r}; tools: {', '.join(TOOLS_BY_NAME)}", True
    if not isinstance(arguments, dict):
        return "error: arguments must be an object", True
    try:
        return str(fn(**arguments)), False
    except (TypeError, ValueError, ArithmeticError) as e:
        return f"error: {e}", True
