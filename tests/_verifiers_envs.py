"""verifiers environments written with verifiers' public API, for the tests.

``load_single_turn``: a ``SingleTurnEnv`` on the tiny model's arithmetic word problems
(reward: the ``#### N`` answer is right, weight 1; a short answer, weight 0.5;
``raise_on_odd=True`` adds a reward function that raises on rows with an odd answer).
``load_tool_env``: a ``ToolEnv`` with the tiny tool model's ``calculator`` tool (reward:
the last message states the right number). Every scored rollout is recorded in ``SCORED``
(trajectory id -> ``calls`` (model calls), ``text`` (its last message), ``answer``).
"""

from __future__ import annotations

import ast
import operator
import re

import verifiers as vf
from datasets import Dataset

from areal.dataset.synthetic import ArithSpec, generate_arith_problems

SCORED: dict[str, dict] = {}


def _rows(n: int, seed: int, digits: int = 1, split: str = "train") -> Dataset:
    problems = generate_arith_problems(ArithSpec(digits=digits, steps=2, n=n, seed=seed), split)
    return Dataset.from_list(
        [{"question": p["question"], "answer": str(p["result"])} for p in problems]
    )


def _last_text(completion) -> str:
    for msg in reversed(completion):
        content = msg.get("content") if isinstance(msg, dict) else getattr(msg, "content", None)
        if isinstance(content, str) and content:
            return content
    return ""


def correct_answer(completion, answer, **kwargs) -> float:
    found = re.findall(r"####\s*(-?\d+)", _last_text(completion))
    return 1.0 if found and found[-1] == answer else 0.0


def short_answer(completion) -> float:
    return 1.0 / (1.0 + len(_last_text(completion)) / 40.0)


def odd_answer_raises(answer) -> float:
    if int(answer) % 2:
        raise RuntimeError(f"the rubric raises on odd answers ({answer})")
    return 0.0


def n_calls(state) -> float:
    calls = len(state["trajectory"])
    text = _last_text(state["completion"])
    SCORED[state["trajectory_id"]] = {"calls": calls, "text": text, "answer": state["answer"]}
    return float(calls)


def load_single_turn(n: int = 64, raise_on_odd: bool = False) -> vf.SingleTurnEnv:
    funcs, weights = [correct_answer, short_answer, n_calls], [1.0, 0.5, 0.0]
    if raise_on_odd:
        funcs.append(odd_answer_raises)
        weights.append(1.0)
    return vf.SingleTurnEnv(
        dataset=_rows(n, seed=5),
        eval_dataset=_rows(8, seed=5, split="test"),
        rubric=vf.Rubric(funcs=funcs, weights=weights),
    )


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * and integers.

    Args:
        expression: the expression, e.g. "31 + 45 - 12".
    """
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only integers and + - *")

    return str(ev(ast.parse(expression, mode="eval").body))


def states_answer(completion, answer, **kwargs) -> float:
    numbers = re.findall(r"-?\d+", _last_text(completion))
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def load_tool_env(n: int = 64) -> vf.ToolEnv:
    env = vf.ToolEnv(
        dataset=_rows(n, seed=7, digits=2),
        tools=[calculator],
        max_turns=3,
        rubric=vf.Rubric(funcs=[states_answer, n_calls], weights=[1.0, 0.0]),
    )
    return env


def group_best(completions, **kwargs) -> list[float]:
    """A group reward function: 1 for the shortest answer of the group."""
    lengths = [len(_last_text(c)) for c in completions]
    return [1.0 if n == min(lengths) else 0.0 for n in lengths]


def load_group_env(n: int = 16) -> vf.SingleTurnEnv:
    return vf.SingleTurnEnv(
        dataset=_rows(n, seed=9),
        rubric=vf.Rubric(funcs=[correct_answer, group_best, n_calls], weights=[1.0, 2.0, 0.0]),
    )
