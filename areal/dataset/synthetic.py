"""Synthetic arithmetic word problems in GSM8K's format, for CPU-sized models.

Every row has GSM8K's two fields: ``question`` (a short word problem) and ``answer``
(one reasoning line per step, then a final ``#### N`` line)::

    question: "Mia has 7 apples. She buys 5 more apples. Then she gives away 3 apples.
               How many apples does Mia have now?"
    answer:   "7 + 5 = 12\\n12 - 3 = 9\\n#### 9"

Difficulty knobs (:class:`ArithSpec`):

- ``digits``: operands have exactly this many digits (1 -> 1..9, 2 -> 10..99, ...).
- ``steps``: number of operations applied to the starting amount (>= 1).
- ``ops``: allowed operations, a subset of ``add``, ``sub``, ``mul``. Subtraction never
  goes below zero: a ``sub`` step whose operand exceeds the current amount becomes ``add``.
- ``n``: number of rows; ``seed``: generator seed.

The generator is a pure function of (spec, split): the same spec and split give the same
rows in any process; different splits (``train``/``test``/...) give independent streams.

As a dataset path (``DatasetConfig.path``), the spec is written as a URL::

    synthetic://arith?digits=1&steps=2&ops=add,sub&n=5000&seed=0

(any field may be omitted; defaults are those of :class:`ArithSpec`).
``synthetic://arith_pref?...`` (same fields) gives preference pairs on the same problems:
the correct answer chosen, the off-by-one answer (last line and final number ``N + 1``)
rejected; see :func:`generate_arith_preference_pairs`.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

VALID_OPS = ("add", "sub", "mul")
SCHEME = "synthetic://"
# arith: problems (question/answer); arith_pref: preference pairs on the same problems
SYNTHETIC_KINDS = ("arith", "arith_pref")

_NAMES = [
    ("Mia", "She"),
    ("Tom", "He"),
    ("Ana", "She"),
    ("Ben", "He"),
    ("Zoe", "She"),
    ("Sam", "He"),
    ("Lily", "She"),
    ("Max", "He"),
    ("Ella", "She"),
    ("Leo", "He"),
]
_ITEMS = ["apples", "books", "coins", "cards", "pens", "shells", "stamps", "eggs", "toys", "cups"]
_ADD = ["{p} buys {b} more {item}.", "{p} finds {b} more {item}.", "{p} gets {b} more {item}."]
_SUB = ["{p} gives away {b} {item}.", "{p} loses {b} {item}.", "{p} sells {b} {item}."]
_MUL = ["{p} makes the number of {item} {b} times as large."]
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}


@dataclass(frozen=True)
class ArithSpec:
    """Difficulty and size of a synthetic arithmetic dataset (see module docstring)."""

    digits: int = 1
    steps: int = 2
    ops: tuple[str, ...] = ("add", "sub")
    n: int = 5000
    seed: int = 0

    def __post_init__(self):
        if self.digits < 1 or self.digits > 6:
            raise ValueError(f"synthetic digits={self.digits}; must be in [1, 6]")
        if self.steps < 1 or self.steps > 20:
            raise ValueError(f"synthetic steps={self.steps}; must be in [1, 20]")
        if not self.ops or any(op not in VALID_OPS for op in self.ops):
            raise ValueError(
                f"synthetic ops={list(self.ops)}; must be a non-empty subset of {list(VALID_OPS)}"
            )
        if self.n < 0:
            raise ValueError(f"synthetic n={self.n}; must be >= 0")

    def to_path(self) -> str:
        return (
            f"{SCHEME}arith?digits={self.digits}&steps={self.steps}"
            f"&ops={','.join(self.ops)}&n={self.n}&seed={self.seed}"
        )


def is_synthetic_path(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def synthetic_kind(path: str) -> str:
    """``"arith"`` or ``"arith_pref"`` (validated by :func:`parse_synthetic_path`)."""
    parse_synthetic_path(path)
    url = urlparse(path)
    return url.netloc or url.path.strip("/")


def parse_synthetic_path(path: str) -> ArithSpec:
    """``synthetic://arith?digits=1&steps=2&...`` -> :class:`ArithSpec` (clear errors)."""
    if not is_synthetic_path(path):
        raise ValueError(f"not a synthetic dataset path: {path!r} (expected '{SCHEME}arith?...')")
    url = urlparse(path)
    kind = url.netloc or url.path.strip("/")
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(
            f"synthetic dataset kind {kind!r} in {path!r}; only 'arith' (problems) and "
            "'arith_pref' (preference pairs) exist"
        )
    query = parse_qs(url.query, keep_blank_values=True)
    fields = {f.name for f in dataclasses.fields(ArithSpec)}
    unknown = set(query) - fields
    if unknown:
        raise ValueError(
            f"unknown synthetic parameter(s) {sorted(unknown)} in {path!r}; allowed: {sorted(fields)}"
        )
    kwargs: dict = {}
    for key, values in query.items():
        value = values[-1]
        if key == "ops":
            kwargs["ops"] = tuple(op.strip() for op in value.split(",") if op.strip())
        else:
            try:
                kwargs[key] = int(value)
            except ValueError as e:
                raise ValueError(
                    f"synthetic parameter {key}={value!r} in {path!r}; must be an integer"
                ) from e
    return ArithSpec(**kwargs)


def _operand(rng: random.Random, digits: int) -> int:
    lo = 1 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(lo, 10**digits - 1)


def make_problem(rng: random.Random, spec: ArithSpec) -> dict:
    """One problem: ``question``, ``answer`` (GSM8K format) and the integer ``result``."""
    name, pronoun = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    value = _operand(rng, spec.digits)
    sentences = [f"{name} has {value} {item}."]
    lines = []
    for i in range(spec.steps):
        op = rng.choice(spec.ops)
        b = _operand(rng, spec.digits)
        if op == "sub" and b > value:  # never below zero
            op = "add"
        template = rng.choice({"add": _ADD, "sub": _SUB, "mul": _MUL}[op])
        sentence = template.format(p=pronoun, b=b, item=item)
        sentences.append(("Then " + sentence[0].lower() + sentence[1:]) if i > 0 else sentence)
        new = value + b if op == "add" else value - b if op == "sub" else value * b
        lines.append(f"{value} {_SYMBOL[op]} {b} = {new}")
        value = new
    sentences.append(f"How many {item} does {name} have now?")
    return {
        "question": " ".join(sentences),
        "answer": "\n".join(lines) + f"\n#### {value}",
        "result": value,
    }


def _split_rng(spec: ArithSpec, split: str) -> random.Random:
    # str seeds are hashed deterministically (sha512) by random.Random, unlike hash().
    return random.Random(f"areal-arith|{spec.seed}|{split}")


def generate_arith_problems(spec: ArithSpec, split: str = "train") -> list[dict]:
    """``spec.n`` rows of ``{"question", "answer", "result"}``; deterministic in (spec, split)."""
    rng = _split_rng(spec, split)
    return [make_problem(rng, spec) for _ in range(spec.n)]


def off_by_one_answer(answer: str, result: int) -> str:
    """``answer`` with its last reasoning line and final line off by one (``N + 1``): the
    error the demo's imperfect base model makes."""
    lines = answer.split("\n")
    last = lines[-2]
    head, _, _ = last.rpartition("= ")
    lines[-2] = f"{head}= {result + 1}"
    lines[-1] = f"#### {result + 1}"
    return "\n".join(lines)


def generate_arith_preference_pairs(spec: ArithSpec, split: str = "train") -> list[dict]:
    """Preference pairs on the arithmetic problems of ``(spec, split)``: ``question``,
    ``chosen`` (the correct answer) and ``rejected`` (:func:`off_by_one_answer`)."""
    return [
        {
            "question": r["question"],
            "chosen": r["answer"],
            "rejected": off_by_one_answer(r["answer"], r["result"]),
        }
        for r in generate_arith_problems(spec, split)
    ]
