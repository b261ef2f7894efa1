"""Geometry3K reward: the completion's final answer against the ground truth, by math-verify.

AReaL's convention: the answer is the last ``[...]`` group of the completion (the
bracketed answer Geometry3K's ground truths use), else its last ``\\boxed{...}``, else its
last number. The ground truth is read the same way (bracketed or bare). Equality is
checked by math-verify (``2\\sqrt{3}``, ``\\frac{1}{2}`` = ``0.5``, ...); plain numbers are
compared numerically first.
"""

from __future__ import annotations

import re

from areal.reward import get_math_verify_worker, last_boxed, parse_number
from areal.utils import logging

logger = logging.getLogger("Geometry3KReward")

_BRACKET_RE = re.compile(r"\[([^\[\]]+)\]")
_LAST_NUM_RE = re.compile(r"-?\d*\.?\d+")


def extract_answer(pred_str: str, use_last_number: bool = True) -> str:
    """Last ``[...]`` content, else last ``\\boxed{}``, else (optionally) the last number."""
    text = str(pred_str)
    matches = _BRACKET_RE.findall(text)
    if matches and matches[-1].strip():
        return matches[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if use_last_number:
        nums = _LAST_NUM_RE.findall(text.replace(",", ""))
        if nums:
            return nums[-1]
    return ""


def geometry3k_reward_fn(
    prompt, completions, prompt_ids, completion_ids, answer, **kwargs
) -> float:
    """AReaL reward signature; 1.0 (equivalent answer) or 0.0."""
    try:
        if isinstance(completions, list | tuple):
            completions = "".join(str(c) for c in completions)
        sol = extract_answer(str(completions))
        gold = extract_answer(str(answer), use_last_number=False) or str(answer).strip()
        if not sol or not gold:
            return 0.0
        a, b = parse_number(sol), parse_number(gold)
        if a is not None and b is not None:
            return 1.0 if abs(a - b) <= 1e-6 * max(1.0, abs(b)) else 0.0
        worker = get_math_verify_worker()
        return worker.verify("\\boxed{" + sol + "}", "\\boxed{" + gold + "}")
    except Exception:
        logger.warning("geometry3k_reward_fn failed; reward 0.0", exc_info=True)
        return 0.0
