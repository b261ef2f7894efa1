"""A verifiers environment written with verifiers' public API (what an Environments Hub
module looks like): ``load_environment(**args)`` returns a ``SingleTurnEnv`` on the tiny
model's arithmetic word problems, with a dataset, an eval dataset and a ``Rubric``.

Train it with ``examples/envs/verifiers_rl.py`` (the environment is named
``arith_vf_env:load_environment``; an installed Hub environment is named by its id).
"""

from __future__ import annotations

import re

import verifiers as vf
from datasets import Dataset

from areal.dataset.synthetic import ArithSpec, generate_arith_problems


def _dataset(n: int, seed: int, split: str) -> Dataset:
    rows = generate_arith_problems(ArithSpec(digits=1, steps=2, n=n, seed=seed), split)
    return Dataset.from_list(
        [{"question": r["question"], "answer": str(r["result"])} for r in rows]
    )


def correct_answer(completion, answer, **kwargs) -> float:
    """1.0 when the last ``#### N`` line of the reply is the answer."""
    text = completion[-1]["content"] if isinstance(completion[-1], dict) else completion[-1].content
    found = re.findall(r"####\s*(-?\d+)", text or "")
    return 1.0 if found and found[-1] == answer else 0.0


def load_environment(n: int = 20000, n_eval: int = 256, seed: int = 0) -> vf.SingleTurnEnv:
    return vf.SingleTurnEnv(
        dataset=_dataset(n, seed, "train"),
        eval_dataset=_dataset(n_eval, seed, "test"),
        rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]),
    )
