"""Reward functions (``xxx_reward_fn``) and answer extraction / verification.

Reward functions are plain synchronous callables with AReaL's signature::

    reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float

Workflows run them through :class:`areal.api.reward_api.AsyncRewardWrapper` (process pool
+ timeout), so they may be slow or crash without hurting the run.

Helpers here:

- :func:`extract_answer` pulls the final answer out of a free-form completion
  (``#### N`` line, ``\\boxed{N}``, "The answer is N", else the last number, taken with
  the arithmetic or LaTeX expression it belongs to: ``$10^3$``, ``3+2``,
  ``1.2 \\times 10^{3}``, ``\\frac{2}{3}``).
- :func:`parse_number` turns an answer string ("$1,000", "5 dollars", "10%") into a float,
  or ``None`` when it is not a plain number.
- :class:`MathVerifyWorker` / :func:`get_math_verify_worker` compare two answers with the
  ``math-verify`` library (symbolic: fractions, LaTeX), with its signal-based timeouts
  disabled so that it also works off the main thread.

``math_verify`` (which pulls in sympy, ~0.7 s) is imported lazily on first use.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from areal.utils import logging

logger = logging.getLogger("RewardUtils")

__all__ = [
    "VALID_REWARD_FN",
    "MathVerifyWorker",
    "answers_match",
    "answers_match_plain",
    "clevr_count_70k_reward_fn",
    "extract_answer",
    "geometry3k_reward_fn",
    "get_custom_reward_fn",
    "get_math_verify_worker",
    "gsm8k_reward_fn",
    "last_boxed",
    "parse_number",
    "reasoning_gym_reward_fn",
]

# Reward functions importable as ``from areal.reward import xxx_reward_fn`` (loaded lazily:
# their modules import helpers from this one).
_LAZY_REWARDS = {
    "gsm8k_reward_fn": "areal.reward.gsm8k",
    "geometry3k_reward_fn": "areal.reward.geometry3k",
    "clevr_count_70k_reward_fn": "areal.reward.clevr_count_70k",
    "reasoning_gym_reward_fn": "areal.reward.reasoning_gym",
}
VALID_REWARD_FN = ["clevr_count_70k", "geometry3k"]


def __getattr__(name: str):
    if name in _LAZY_REWARDS:
        import importlib

        return getattr(importlib.import_module(_LAZY_REWARDS[name]), name)
    raise AttributeError(f"module 'areal.reward' has no attribute {name!r}")


def get_custom_reward_fn(path: str, **kwargs):
    """The reward function of a dataset named in ``path`` (``clevr_count_70k``, ``geometry3k``)."""
    for key in VALID_REWARD_FN:
        if key in str(path):
            return __getattr__(f"{key}_reward_fn")
    raise ValueError(f"no reward function for {path!r}; supported: {VALID_REWARD_FN}")


# A number as written in GSM8K-style text: optional sign, digits with optional thousands
# commas, optional decimals; or a leading-dot decimal.
_NUM = r"(?:(?<![\w.)])[-+])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|=|:)\s*:?\s*([^\n]*)", re.IGNORECASE
)
# Plain number with optional currency before and unit/percent words after.
_PLAIN_RE = re.compile(
    r"^\s*(?:\\?\$|\\\(|\$)?\s*(" + _NUM + r")\s*(?:\\?%|percent)?"
    r"(?:\s*[A-Za-z][A-Za-z.\s/-]*)?\s*(?:\\\)|\$)?[.!]?\s*$"
)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced


# LaTeX math segments: $$..$$, $..$, \(..\), \[..\]
_MATH_SEG_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# An arithmetic / LaTeX expression around numbers (no letters but LaTeX commands, no '=')
_EXPR_TOKEN = (
    r"(?:" + _NUM + r"|\\(?:times|cdot|div|d?t?frac|sqrt|left|right)\b|[+\-*/^(){}×·÷]|[ \t])"
)
_EXPR_RE = re.compile(_EXPR_TOKEN + r"+")
# structure that makes an expression more than its last number
_STRUCT_RE = re.compile(r"\d\s*(?:[+\-*/^×·÷]|\\times|\\cdot|\\div)\s*[\d({\\]|\\d?t?frac|\\sqrt")


def _final_expression(text: str, last_num: re.Match) -> str:
    """The expression the completion's last number belongs to, or that number alone.

    Inside a LaTeX math segment: the segment's right-most side (after its last ``=``).
    In prose: the run of numbers, operators and LaTeX operators around the number, when
    it has an operator between numbers (``3+2``, ``1.2 \\times 10^{3}``); a number in
    running text ("5-year-old", "-5") stays that number.
    """
    pos = last_num.start()
    for m in _MATH_SEG_RE.finditer(text):
        if m.start() <= pos < m.end():
            body = next(g for g in m.groups() if g is not None)
            rhs = body.rsplit("=", 1)[-1].strip().rstrip(".,;")
            return rhs if any(c.isdigit() for c in rhs) else last_num.group(0)
    for m in _EXPR_RE.finditer(text):
        if m.start() <= pos < m.end():
            expr = m.group(0).strip().rstrip("+-*/^×·÷ ")
            if _STRUCT_RE.search(expr) and expr.count("{") == expr.count("}"):
                return expr
            break
    return last_num.group(0)


def extract_answer(text: str) -> str | None:
    """Final answer string of a completion, or ``None`` when there is none.

    Priority: last ``#### X`` line, last ``\\boxed{X}``, last "the answer is X", else the
    last number anywhere in the text, with the expression it belongs to
    (:func:`_final_expression`).
    """
    if not isinstance(text, str) or not text.strip():
        return None
    hashes = _HASH_RE.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    said = _ANSWER_IS_RE.findall(text)
    if said and said[-1].strip():
        return said[-1].strip()
    last = None
    for last in _NUM_RE.finditer(text):  # noqa: B007 (the last match is what we want)
        pass
    if last is not None:
        return _final_expression(text, last)
    return None


def parse_number(s: str) -> float | None:
    """Float value of a plain numeric answer ("1,000", "$5", "5 dollars.", "10%").

    Returns ``None`` for anything else (LaTeX, fractions, expressions, garbage); callers
    then fall back to math-verify.
    """
    if not isinstance(s, str):
        return None
    s = s.replace("\\!", "").replace("\\,", "").replace("{,}", ",").strip()
    m = _PLAIN_RE.match(s)
    if m is None:
        return None
    try:
        return float(m.group(1).replace(",", ""))
    except ValueError:
        return None


_LEADING_RE = re.compile(
    r"^\s*(?:\\?\$)?\s*(" + _NUM + r")(?![.,]\d)(?!\s*(?:[-+*/^=\d×·÷]|\\(?:times|cdot|div)\b))"
)


def _leading_number(s: str) -> float | None:
    """Number at the start of a sentence-like answer ("18, because ..."), not of an expression."""
    m = _LEADING_RE.match(s)
    if m is None:
        return None
    try:
        return float(m.group(1).replace(",", ""))
    except ValueError:
        return None


def _numbers_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


class MathVerifyWorker:
    """Symbolic answer comparison with ``math_verify.parse`` + ``math_verify.verify``.

    Timeouts inside math-verify are signal based (main thread only), so they are turned
    off here; run the reward in :class:`~areal.api.reward_api.AsyncRewardWrapper` for a
    wall-clock limit.

    Args:
        precision: decimal places compared for floats (math-verify's ``float_rounding``).
    """

    def __init__(self, precision: int = 6):
        self.precision = precision

    @staticmethod
    @lru_cache(maxsize=16384)
    def _parse_cached(text: str):
        from math_verify import parse

        return tuple(parse(text, parsing_timeout=None))

    def verify(self, response: str, ground_truth: str) -> float:
        """1.0 when math-verify finds ``response`` equivalent to ``ground_truth``."""
        from math_verify import verify

        try:
            gold = list(self._parse_cached(str(ground_truth)))
            pred = list(self._parse_cached(str(response)))
            if not gold or not pred:
                return 0.0
            ok = verify(gold, pred, float_rounding=self.precision, timeout_seconds=None)
            return 1.0 if ok else 0.0
        except Exception:
            logger.warning(
                "math-verify failed on response=%r ground_truth=%r",
                response,
                ground_truth,
                exc_info=True,
            )
            return 0.0


_MATH_VERIFY_WORKER: MathVerifyWorker | None = None


def get_math_verify_worker() -> MathVerifyWorker:
    """Process-wide :class:`MathVerifyWorker`."""
    global _MATH_VERIFY_WORKER
    if _MATH_VERIFY_WORKER is None:
        _MATH_VERIFY_WORKER = MathVerifyWorker()
    return _MATH_VERIFY_WORKER


_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _as_latex(ans: str) -> str:
    """Wrap an extracted answer so that math-verify reads it as the final answer (math
    delimiters and a closing full stop removed: "$10^3$." is ``10^3``)."""
    ans = ans.strip().rstrip(".!").strip()
    for a, b in _DELIMS:
        if len(ans) > len(a) + len(b) and ans.startswith(a) and ans.endswith(b):
            ans = ans[len(a) : -len(b)].strip()
            break
    return "\\boxed{" + ans + "}"


@lru_cache(maxsize=65536)
def _ground_truth_answer(answer: str) -> tuple[str, float | None]:
    """(answer string, numeric value or None) of a ground truth, cached.

    Accepts a full GSM8K solution (final ``#### N`` line) or a bare answer.
    """
    hashes = _HASH_RE.findall(answer)
    gold = hashes[-1].strip() if hashes and hashes[-1].strip() else answer.strip()
    return gold, parse_number(gold)


def _plain_verdict(completion: str, answer: str) -> tuple[bool | None, str | None, str]:
    """(verdict where no math-verify is needed, else None; predicted answer; gold)."""
    if not isinstance(completion, str) or answer is None:
        return False, None, ""
    pred = extract_answer(completion)
    if pred is None:
        return False, None, ""
    gold, gold_num = _ground_truth_answer(str(answer))
    if not gold:
        return False, pred, gold
    pred_num = parse_number(pred)
    if pred_num is None:
        pred_num = _leading_number(pred)
    if gold_num is not None and pred_num is not None:
        return _numbers_close(gold_num, pred_num), pred, gold
    return None, pred, gold


def answers_match_plain(completion: str, answer: str) -> bool | None:
    """``answers_match`` where it needs no math-verify: plain numbers on both sides
    (tolerance 1e-6), or no answer at all; ``None`` where only math-verify can tell."""
    return _plain_verdict(completion, answer)[0]


def answers_match(completion: str, answer: str) -> bool:
    """Whether the final answer of ``completion`` equals the ground truth ``answer``.

    Plain numbers on both sides are compared numerically (fast path, tolerance 1e-6);
    anything else goes through math-verify.
    """
    verdict, pred, gold = _plain_verdict(completion, answer)
    if verdict is not None:
        return verdict
    # Symbolic fallback: fractions, LaTeX, expressions.
    return get_math_verify_worker().verify(_as_latex(pred), _as_latex(gold)) == 1.0
