"""CLEVR-Count-70K reward: 1.0 when the completion's last bracketed number is the count.

AReaL's convention: the model answers with the number in square brackets (``[3]``); the
last ``[number]`` of the completion is compared with the ground-truth ``answer`` (a bare
number, or itself bracketed) as numbers. No bracketed number -> 0.0.
"""

from __future__ import annotations

import re

from areal.utils import logging

logger = logging.getLogger("CLEVR70KReward")

_BRACKET_NUM_RE = re.compile(r"\[\s*(-?[0-9]+(?:\.[0-9]+)?)\s*\]")


def extract_answer(pred_str: str, data_name: str = "", use_last_number: bool = True) -> str:
    """The last ``[number]`` in ``pred_str`` (without brackets), or ``""``."""
    matches = _BRACKET_NUM_RE.findall(str(pred_str))
    return matches[-1] if matches else ""


def _as_number(s: str) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def clevr_count_70k_reward_fn(
    prompt, completions, prompt_ids, completion_ids, answer, **kwargs
) -> float:
    """AReaL reward signature; 1.0 (the bracketed count equals ``answer``) or 0.0."""
    try:
        if isinstance(completions, list | tuple):
            completions = "".join(str(c) for c in completions)
        sol = extract_answer(str(completions))
        if not sol or answer is None:
            return 0.0
        gold = extract_answer(str(answer)) or str(answer).strip()
        a, b = _as_number(sol), _as_number(gold)
        if a is not None and b is not None:
            return 1.0 if abs(a - b) < 1e-9 else 0.0
        return 1.0 if sol.strip() == gold else 0.0
    except Exception:
        logger.warning("clevr_count_70k_reward_fn failed; reward 0.0", exc_info=True)
        return 0.0
