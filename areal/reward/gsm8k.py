"""GSM8K reward: 1.0 when the completion's final answer equals the ground truth.

The completion's answer is its last ``#### N`` line, else its last ``\\boxed{N}``, else
"The answer is N", else its last number. The ground truth is either a full GSM8K
solution (final ``#### N`` line) or a bare answer. Plain numbers ("1,000", "$5",
"5 dollars", "10%") are compared numerically with tolerance 1e-6 (absolute) / 1e-9 (relative); anything else
(fractions, LaTeX) is compared by math-verify.
"""

from __future__ import annotations

from areal.api.reward_api import inline_fast_path
from areal.reward import answers_match, answers_match_plain
from areal.utils import logging

logger = logging.getLogger("GSM8KReward")


def gsm8k_reward_plain(prompt, completions, prompt_ids, completion_ids, answer, **kwargs):
    """``gsm8k_reward_fn`` where it needs no math-verify (plain numbers, or no answer),
    else ``None``: the inline fast path ``AsyncRewardWrapper`` runs in its own thread."""
    if not isinstance(completions, str):
        return None
    match = answers_match_plain(completions, str(answer))
    return None if match is None else float(match)


@inline_fast_path(gsm8k_reward_plain)
def gsm8k_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float:
    """AReaL reward signature; returns 1.0 (correct) or 0.0.

    ``completions`` is the decoded completion text (a list of strings is accepted and
    joined; only text is scored). ``answer`` is the dataset's ground truth.
    """
    if isinstance(completions, list | tuple):
        completions = "".join(str(c) for c in completions)
    try:
        return 1.0 if answers_match(str(completions), str(answer)) else 0.0
    except Exception:
        logger.warning("gsm8k_reward_fn failed; reward 0.0", exc_info=True)
        return 0.0
