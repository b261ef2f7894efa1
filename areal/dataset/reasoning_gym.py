"""Reasoning Gym tasks as datasets: ``reasoning_gym://<task>?size=N&seed=S&<task options>``.

`Reasoning Gym <https://github.com/open-thought/reasoning-gym>`_ (``reasoning-gym``, the
``envs`` extra) has over 100 procedural task generators, each with its own verifier
(``score_answer``). A dataset path names one task, or a weighted mix of tasks::

    reasoning_gym://chain_sum?size=2000&seed=0&min_digits=1&max_digits=1
    reasoning_gym://chain_sum:3,basic_arithmetic:1?size=2000&chain_sum.max_terms=2

- ``size`` (default 1000) rows, generated from ``seed`` (default 0);
- one task: any other key is a field of the task's config dataclass
  (``reasoning_gym.create_dataset(task, **options)``); a mix ``task:weight,...``
  (weights default to 1) takes ``task.field=value`` keys and is Reasoning Gym's own
  ``composite`` dataset (each row drawn from a task with probability proportional to its
  weight);
- values are converted to the field's type: integers, floats, booleans
  (``true``/``false``/``1``/``0``), strings, ``none``, and comma-separated lists for list
  or tuple fields (``operators=+,-``: a ``+`` is a plus sign here, not a space; write
  ``%2C`` for a literal comma).

An unknown task, option or value is a ``ValueError`` that names what is allowed (every
task's name for a bad task).

Splits: split ``train`` is generated from ``seed``; any other split (``test``,
``valid``, ...) from a seed derived from ``(seed, split)`` at least 10^7 away from it, so the
same path gives a held-out split. Reasoning Gym seeds its row ``i`` with ``seed + i``: two
paths whose ``[seed, seed + size)`` ranges overlap share rows (the derived seeds never
overlap a training range below 10^7 rows). Tasks with small problem spaces (1-digit sums)
repeat questions under any seed.

RL rows: ``messages`` (the task's question as one user turn, plus ``prompt_suffix``),
``answer`` (the task's reference answer), ``task`` (the task that generated the row),
``rg_dataset`` (the row's dataset as a path with its effective seed) and ``rg_index``.
The reward :func:`areal.reward.reasoning_gym.reasoning_gym_reward_fn` rebuilds the
entry from the last two and scores the completion with the dataset's own
``score_answer``.
"""

from __future__ import annotations

from typing import Any

from areal.dataset.rows import LengthFilter
from areal.utils import logging
from areal.utils.reasoning_gym import (
    RG_SCHEME,
    available_tasks,
    build_rg_dataset,
    is_reasoning_gym_path,
    parse_reasoning_gym_path,
    split_seed,
)

logger = logging.getLogger("ReasoningGymDataset")

__all__ = [
    "RG_SCHEME",
    "available_tasks",
    "build_rg_dataset",
    "get_reasoning_gym_dataset",
    "is_reasoning_gym_path",
    "parse_reasoning_gym_path",
    "split_seed",
]


def _n_prompt_tokens(tokenizer: Any, messages: list[dict]) -> int:
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return len(out)
    return len(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])


def get_reasoning_gym_dataset(
    path: str,
    split: str,
    type: str = "rl",
    tokenizer: Any = None,
    max_length: int | None = None,
    prompt_suffix: str = "",
):
    """``datasets.Dataset`` of the RL rows of ``path``'s ``split`` (module docstring)."""
    if type != "rl":
        raise ValueError(
            f"dataset {path!r}: type={type!r}; Reasoning Gym tasks give RL rows only (type 'rl')"
        )
    if max_length is not None and tokenizer is None:
        raise ValueError("max_length filtering needs a tokenizer")
    spec = parse_reasoning_gym_path(path)
    spec = spec.with_seed(split_seed(spec.seed, split))
    ds = build_rg_dataset(spec)
    canonical = spec.to_path()
    lengths = LengthFilter(max_length, f"{path}[{split}]", logger)
    rows = []
    for i in range(spec.size):
        entry = ds[i]
        messages = [{"role": "user", "content": str(entry["question"]) + (prompt_suffix or "")}]
        if max_length is not None and lengths.too_long(_n_prompt_tokens(tokenizer, messages)):
            continue
        rows.append(
            {
                "messages": messages,
                "answer": str(entry["answer"]),
                "task": str(entry.get("metadata", {}).get("source_dataset", spec.tasks[0][0])),
                "rg_dataset": canonical,
                "rg_index": i,
            }
        )
    return lengths.dataset(rows, spec.size, type)
