"""Hand-labelled hard cases of the GSM8K / math answer checker (areal.reward.answers_match
through gsm8k_reward_fn): each row is (completion, gold, expected verdict, why)."""

from __future__ import annotations

import time

import pytest

from areal.reward.gsm8k import gsm8k_reward_fn, gsm8k_reward_plain

# fmt: off
HARD_CASES = [
    # --- the cases: 1 with math-verify
    ("$10^3$", "1000", 1.0, "a power in a LaTeX segment is 1000"),
    ("$1 \\times 10^3$", "1000", 1.0, "scientific notation with \\times"),
    ("1.2 \\times 10^{3}", "1200", 1.0, "unboxed, undelimited LaTeX product"),
    ("The answer is 10^3.", "1000", 1.0, "'the answer is' + expression + full stop"),
    ("3+2", "5", 1.0, "an unevaluated sum equals its value"),
    ("$\\frac{\\frac{1}{2}}{\\frac{3}{4}} = \\frac{2}{3}$", "2/3", 1.0,
     "nested fractions; the right-most side of the equation is the answer"),
    # --- neighbours
    ("So the total is $1{,}000$.", "1000", 1.0, "LaTeX thousands separator {,}"),
    ("We get \\(\\dfrac{2}{3}\\)", "2/3", 1.0, "\\dfrac in \\( \\) delimiters"),
    ("The ratio is \\frac{2}{3}", "2/3", 1.0, "unboxed, undelimited \\frac"),
    ("The answer is $\\frac{4}{6}$.", "2/3", 1.0, "an equivalent unreduced fraction"),
    ("\\boxed{10^3}", "1000", 1.0, "boxed power (worked before)"),
    ("#### 1,200", "1200", 1.0, "GSM8K final line with thousands comma"),
    ("#### $1200", "1200", 1.0, "GSM8K final line with currency"),
    ("#### 50%", "50", 1.0, "percent sign on a GSM8K final line"),
    ("x = 5", "5", 1.0, "an assignment: the last number"),
    ("She pays 12 dollars.", "12", 1.0, "a unit word after the number"),
    ("Total: 4 * 12 = 48", "48", 1.0, "an equation: the number after '=' is last"),
    ("He is a 5-year-old", "5", 1.0, "a hyphenated word is not a subtraction"),
    ("It dropped to -5", "-5", 1.0, "a negative number, not an expression"),
    ("$2.5 \\cdot 4$", "10", 1.0, "\\cdot product"),
    # --- negatives: wrong answers stay 0
    ("$10^3$", "999", 0.0, "1000 is not 999"),
    ("3+4", "5", 0.0, "the sum is 7"),
    ("1.2 \\times 10^{2}", "1200", 0.0, "120, not 1200"),
    ("$\\frac{3}{2}$", "2/3", 0.0, "the reciprocal"),
    ("I first thought 1000, but the right total is 999.", "1000", 0.0,
     "the right number in the middle does not count: the last answer does"),
    ("Maybe $10^3$? No: the count is 7.", "1000", 0.0, "a later plain number overrides the expression"),
    ("#### 1000\nActually 3+2", "5", 0.0, "the #### line has priority over a later expression"),
    ("The total is 5 6", "56", 0.0, "two numbers separated by a space are not 56"),
    ("no number here", "5", 0.0, "no answer at all"),
    ("50%", "0.5", 0.0, "a plain 50% is fifty, the GSM8K reading"),
]
# fmt: on


@pytest.mark.parametrize(("completion", "gold", "expected", "why"), HARD_CASES)
def test_reward_hard_case_table_verdict_matches_label(completion, gold, expected, why):
    assert gsm8k_reward_fn("q", completion, [], [], gold) == expected, why


def test_reward_inline_fast_path_agrees_with_the_full_function_or_defers():
    """gsm8k_reward_plain (run inline by AsyncRewardWrapper) gives the full function's
    verdict wherever it answers, answers every plain-number case, and defers (None) on
    the ones that need math-verify."""
    answered = 0
    for completion, gold, expected, why in HARD_CASES:
        fast = gsm8k_reward_plain("q", completion, [], [], gold)
        if fast is not None:
            answered += 1
            assert fast == expected, why
    assert gsm8k_reward_plain("q", "#### 1,200", [], [], "1200") == 1.0
    assert gsm8k_reward_plain("q", "so it is 7", [], [], "#### 8") == 0.0
    assert gsm8k_reward_plain("q", "no number here", [], [], "5") == 0.0
    assert gsm8k_reward_plain("q", "The ratio is \\frac{2}{3}", [], [], "2/3") is None
    assert gsm8k_reward_plain("q", ["#### 5"], [], [], "5") is None  # lists: the full path
    assert 10 <= answered < len(HARD_CASES)


def test_reward_plain_number_fast_path_stays_fast():
    # plain numbers never reach math-verify: 2,000 scorings well under a second
    t0 = time.perf_counter()
    for i in range(2000):
        assert gsm8k_reward_fn("q", f"so the answer is {i}", [], [], str(i)) == 1.0
    assert time.perf_counter() - t0 < 5.0
