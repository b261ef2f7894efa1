"""The necessary-tool task: ``A * B + C`` problems, seeded, and their training transcripts.

Each row: ``question`` (one of :data:`TEMPLATES` filled with two-digit ``A``, ``B`` and a
three-digit ``C``), ``answer`` (GSM8K style, ``"47 * 86 = 4042\\n4042 + 315 = 4357\\n####
4357"``), ``result`` (the integer) and ``template`` (its index). Rows are deterministic in
``(n, seed, split)``; the splits ``train`` and ``test`` draw from separate streams and the
test split never repeats a training problem of the same seed.

:func:`transcript` renders one episode as chat messages for the pretraining of
``tiny-tool-mix`` (``examples/tool_task/build_tiny_tool_mix.py``): ``tool`` (two calls of
the one-operation calculator, :mod:`areal.reward.tool_arith`, then the copied answer) or
``direct`` (an immediate answer with a wrong guess of the right size).
:func:`tool_arith_dataset` gives the RL rows (``messages``, ``answer``) the trainer reads.
"""

from __future__ import annotations

import random
from typing import Any

from areal.dataset.gsm8k import build_gsm8k_dataset

# Template 0 names the tool; the pretraining mix calls it far more often there.
TEMPLATES = (
    "Use the calculator: what is {a} * {b} + {c}?",
    "What is {a} * {b} + {c}?",
    "Compute {a} * {b} + {c}.",
    "Find the value of {a} * {b} + {c}.",
)
_SPLIT_SALT = {"train": 0, "test": 7919, "tokenizer": 104729}


def make_problem(rng: random.Random) -> dict[str, Any]:
    a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(100, 999)
    t = rng.randrange(len(TEMPLATES))
    p = a * b
    return {
        "question": TEMPLATES[t].format(a=a, b=b, c=c),
        "answer": f"{a} * {b} = {p}\n{p} + {c} = {p + c}\n#### {p + c}",
        "result": p + c,
        "template": t,
        "operands": (a, b, c),
    }


def generate_tool_arith_problems(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` problems of ``split``; the test split excludes the same seed's first 20,000
    training problems."""
    if split not in _SPLIT_SALT:
        raise ValueError(f"split={split!r}; allowed: {sorted(_SPLIT_SALT)}")
    rng = random.Random(seed * 1_000_003 + _SPLIT_SALT[split])
    seen: set = set()
    if split == "test":
        train_rng = random.Random(seed * 1_000_003)
        seen = {make_problem(train_rng)["operands"] for _ in range(20_000)}
    rows: list[dict] = []
    while len(rows) < n:
        row = make_problem(rng)
        if row["operands"] not in seen:
            rows.append(row)
    return rows


def _call(i: int, expression: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expression}},
            }
        ],
    }


def transcript(row: dict, mode: str, rng: random.Random) -> list[dict[str, Any]]:
    """Messages of one episode; ``mode`` is ``tool`` (two calls) or ``direct`` (a guess)."""
    a, b, c = row["operands"]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": row["question"]}]
    if mode == "direct":
        guess = row["result"] + rng.choice([-1, 1]) * rng.randint(1, 400)
        msgs.append({"role": "assistant", "content": f"The answer is {guess}."})
        return msgs
    if mode != "tool":
        raise ValueError(f"mode={mode!r}; allowed: tool, direct")
    p = a * b
    msgs += [
        _call(0, f"{a} * {b}"),
        {"role": "tool", "content": str(p), "tool_call_id": "call_0"},
        _call(1, f"{p} + {c}"),
        {"role": "tool", "content": str(p + c), "tool_call_id": "call_1"},
        {"role": "assistant", "content": f"The answer is {p + c}."},
    ]
    return msgs


def parse_tool_arith_path(path: str) -> dict[str, int]:
    """``tool_arith://?n=20000&seed=1`` -> ``{"n": 20000, "seed": 1}``."""
    if not path.startswith("tool_arith://"):
        raise ValueError(f"path={path!r}; expected 'tool_arith://?n=N&seed=S'")
    query = path.split("?", 1)[1] if "?" in path else ""
    out = {"n": 1000, "seed": 0}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key not in out:
            raise ValueError(f"path={path!r}: unknown key {key!r}; allowed: n, seed")
        out[key] = int(value)
    return out


def tool_arith_dataset(path: str, split: str):
    """The RL rows (``messages``, ``answer``) of ``tool_arith://?n=N&seed=S``, ``split``."""
    spec = parse_tool_arith_path(path)
    rows = generate_tool_arith_problems(spec["n"], spec["seed"], split)
    return build_gsm8k_dataset(rows, "rl", source=f"{path}[{split}]")
