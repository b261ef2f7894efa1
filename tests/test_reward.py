"""Tests of the GSM8K reward, answer extraction and AsyncRewardWrapper."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from areal.api.reward_api import AsyncRewardWrapper, RewardFunctionError, inline_fast_path
from areal.reward import extract_answer, parse_number
from areal.reward.gsm8k import gsm8k_reward_fn

# The GSM8K test split is vendored in the repository (MIT licence, tests/data/gsm8k).
GSM8K_TEST = Path(__file__).resolve().parent / "data" / "gsm8k" / "test.jsonl"


def _r(completion: str, answer: str) -> float:
    return gsm8k_reward_fn("q", completion, [], [], answer)


# --------------------------------------------------------------------- gsm8k reward
def test_gsm8k_reward_gold_solutions_all_correct_and_off_by_one_wrong():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    wrong_gold = []
    wrong_perturbed = []
    for row in rows:
        sol = row["answer"]
        if _r(sol, sol) != 1.0:
            wrong_gold.append(sol[-60:])
        body, final = sol.rsplit("####", 1)
        value = float(final.strip().replace(",", ""))
        perturbed = (
            body + "#### " + f"{value + 1:g}"
            if value != int(value)
            else body + f"#### {int(value) + 1}"
        )
        if _r(perturbed, sol) != 0.0:
            wrong_perturbed.append(perturbed[-60:])
    assert wrong_gold == []
    assert wrong_perturbed == []  # its speed: benchmarks/bench_reward.py


@pytest.mark.parametrize(
    "completion,answer",
    [
        ("Adding up, we get \\boxed{18}.", "18"),
        ("So she makes 9 * 2 = 18 dollars. The answer is 18.", "#### 18"),
        ("The answer is $1,000.", "1000"),
        ("The answer is 5 dollars.", "5"),
        ("#### 10%", "10"),
        ("The final answer is 70,000", "Profit...\n#### 70000"),
        ("Half of it: \\boxed{\\frac{1}{2}}", "0.5"),
        ("It is -3 degrees, so the answer is -3", "-3"),
        ("first 3 then 16 - 3 - 4 = 9", "9"),
    ],
)
def test_gsm8k_reward_answer_styles_correct_gives_one(completion, answer):
    assert _r(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion,answer",
    [
        ("Adding up, we get \\boxed{19}.", "18"),
        ("The answer is 17.", "#### 18"),
        ("", "18"),
        ("I don't know", "18"),
        ("@@@@ \\boxed{ ", "18"),
        ("#### banana", "18"),
        ("18 was a guess; the answer is 12", "18"),
        ("#### 18000", "18"),
    ],
)
def test_gsm8k_reward_wrong_or_garbage_gives_zero(completion, answer):
    assert _r(completion, answer) == 0.0


def test_gsm8k_reward_non_string_inputs_give_zero():
    assert gsm8k_reward_fn("q", None, [], [], "18") == 0.0
    assert gsm8k_reward_fn("q", ["The answer is ", "18"], [], [], "18") == 1.0
    assert gsm8k_reward_fn("q", "18", [], [], None) == 0.0


def test_extract_answer_priority_hash_over_boxed_over_last_number():
    assert extract_answer("\\boxed{3}\n#### 4") == "4"
    assert extract_answer("7 then \\boxed{3} and 9") == "3"
    assert extract_answer("7 then 9.") == "9"
    assert extract_answer("no digits") is None
    assert parse_number("$1,234.5 dollars.") == 1234.5
    assert parse_number("\\frac{1}{2}") is None


# --------------------------------------------------------------------- AsyncRewardWrapper
# Module-level so that worker processes can unpickle them.
def ok_reward(x, scale=1.0):
    return float(x) * scale


def raising_reward(x):
    raise ValueError(f"bad input {x}")


def sleepy_reward(x, seconds):
    time.sleep(seconds)
    return float(x)


def crashing_reward(x):
    os._exit(3)


def not_a_number_reward(x):
    return "abc"


def _half_fast(x):
    if x == "raise":
        raise RuntimeError("fast path broke")
    return 1.0 if isinstance(x, int) and x > 0 else None


@inline_fast_path(_half_fast)
def fast_pathed_reward(x):
    return 2.0


@pytest.fixture
def wrapper_cleanup():
    yield
    AsyncRewardWrapper.shutdown()


async def test_async_reward_wrapper_ok_exception_timeout_counted_later_calls_work(wrapper_cleanup):
    w = AsyncRewardWrapper(ok_reward, timeout_seconds=30, max_workers=1)
    assert await w(2, scale=1.5) == 3.0  # warms the pool (process start)
    e = AsyncRewardWrapper(raising_reward, timeout_seconds=30, max_workers=1)
    assert await e(5) == 0.0
    assert e.stats() == {"n_calls": 1, "n_timeouts": 0, "n_errors": 1}

    s = AsyncRewardWrapper(sleepy_reward, timeout_seconds=1.0, max_workers=1)
    t0 = time.perf_counter()
    assert await s(1, seconds=120) == 0.0
    assert time.perf_counter() - t0 < 10
    assert s.stats() == {"n_calls": 1, "n_timeouts": 1, "n_errors": 0}

    # The only worker was stuck in sleep(120): later calls must not wait for it.
    t0 = time.perf_counter()
    assert await w(4) == 4.0
    assert await s(7, seconds=0) == 7.0
    assert time.perf_counter() - t0 < 20
    assert w.stats() == {"n_calls": 2, "n_timeouts": 0, "n_errors": 0}
    assert s.stats()["n_calls"] == 2


async def test_async_reward_wrapper_concurrent_calls_survive_a_timeout(wrapper_cleanup):
    ok = AsyncRewardWrapper(sleepy_reward, timeout_seconds=30, max_workers=2)
    hang = AsyncRewardWrapper(sleepy_reward, timeout_seconds=1.5, max_workers=2)
    assert await ok(0, seconds=0) == 0.0  # pool warm
    results = await asyncio.gather(hang(9, seconds=60), *[ok(i, seconds=0.2) for i in range(1, 6)])
    assert results == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert hang.stats()["n_timeouts"] == 1
    assert ok.stats() == {"n_calls": 6, "n_timeouts": 0, "n_errors": 0}


async def test_async_reward_wrapper_crashing_worker_gives_zero_and_recovers(wrapper_cleanup):
    c = AsyncRewardWrapper(crashing_reward, timeout_seconds=30, max_workers=1, max_retries=1)
    assert await c(1) == 0.0
    assert c.stats()["n_errors"] == 1
    n = AsyncRewardWrapper(not_a_number_reward, timeout_seconds=30, max_workers=1)
    assert await n(1) == 0.0
    assert n.stats()["n_errors"] == 1
    w = AsyncRewardWrapper(ok_reward, timeout_seconds=30, max_workers=1)
    assert await w(3) == 3.0


async def test_async_reward_wrapper_gsm8k_by_dotted_path(wrapper_cleanup):
    w = AsyncRewardWrapper("areal.reward.gsm8k.gsm8k_reward_fn", timeout_seconds=60, max_workers=1)
    r = await asyncio.gather(
        w("q", "so \\boxed{18}", [], [], answer="#### 18"),
        w("q", "#### 17", [], [], answer="#### 18"),
    )
    assert r == [1.0, 0.0]


def test_async_reward_wrapper_unpicklable_fn_raises_clear_error():
    with pytest.raises(TypeError, match="not picklable"):
        AsyncRewardWrapper(lambda *a, **k: 1.0)
    with pytest.raises(ValueError, match="timeout_seconds"):
        AsyncRewardWrapper(ok_reward, timeout_seconds=0)
    with pytest.raises(ValueError, match="no 'nope'"):
        AsyncRewardWrapper("areal.reward.gsm8k.nope")


async def test_async_reward_wrapper_calls_queued_behind_a_timeout_are_retried(wrapper_cleanup):
    """One worker: calls waiting behind a hanging one lose their pool when it is replaced;
    they must be retried on the new pool, not fail the episode with CancelledError."""
    hang = AsyncRewardWrapper(sleepy_reward, timeout_seconds=2.0, max_workers=1)
    ok = AsyncRewardWrapper(sleepy_reward, timeout_seconds=60, max_workers=1, max_retries=3)
    assert await ok(0, seconds=0) == 0.0  # pool warm
    results = await asyncio.gather(hang(9, seconds=60), *[ok(i, seconds=0) for i in range(1, 6)])
    assert results == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert ok.stats()["n_errors"] == 0


async def test_async_reward_wrapper_timeout_excludes_queue_wait_burst_all_scored(wrapper_cleanup):
    """A burst longer than the timeout on one worker: every call is scored, none times out
    (the timeout counts the reward's own run, not its wait for a free worker)."""
    w = AsyncRewardWrapper(sleepy_reward, timeout_seconds=1.0, max_workers=1)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[w(i, seconds=0.25) for i in range(12)])
    assert results == [float(i) for i in range(12)]
    assert time.perf_counter() - t0 >= 12 * 0.25  # really queued: ~3 s > the 1 s timeout
    assert w.stats() == {"n_calls": 12, "n_timeouts": 0, "n_errors": 0}


def test_async_reward_wrapper_works_across_successive_event_loops(wrapper_cleanup):
    """asyncio.run per evaluation: each loop gets its own concurrency slots."""
    w = AsyncRewardWrapper(ok_reward, timeout_seconds=30, max_workers=1)
    for i in range(3):
        assert asyncio.run(w(i)) == float(i)


def sometimes_raising_reward(x):
    if x < 0:
        raise ValueError(f"negative {x}")
    return float(x)


async def test_async_reward_wrapper_raises_once_every_call_keeps_failing(wrapper_cleanup):
    """0.0 for the first ``max_consecutive_errors`` failures in a row; the next raises a
    RewardFunctionError naming the function and the last failure (an episode that fails,
    which the executor's failure monitor counts); one success resets the count."""
    w = AsyncRewardWrapper(
        sometimes_raising_reward, timeout_seconds=30, max_workers=1, max_consecutive_errors=3
    )
    assert [await w(-1) for _ in range(3)] == [0.0, 0.0, 0.0]
    with pytest.raises(RewardFunctionError, match=r"sometimes_raising_reward failed on 4 calls"):
        await w(-2)
    with pytest.raises(RewardFunctionError, match=r"negative -3"):
        await w(-3)
    assert await w(5) == 5.0  # a success: the count starts again
    assert [await w(-1) for _ in range(3)] == [0.0, 0.0, 0.0]
    unlimited = AsyncRewardWrapper(
        raising_reward, timeout_seconds=30, max_workers=1, max_consecutive_errors=None
    )
    assert [await unlimited(i) for i in range(5)] == [0.0] * 5
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        AsyncRewardWrapper(ok_reward, max_consecutive_errors=0)


_HELPER = '''
import sys


def worker_modules(x=None):
    """Which of the script and torch this worker has imported, as a number 0-3."""
    script = getattr(sys.modules.get("__mp_main__"), "IS_TRAIN_SCRIPT", False)
    return float(script) + 2.0 * float("torch" in sys.modules)
'''

_SCRIPT = """
import asyncio
import json
import sys

import torch  # what a training script imports; a worker that imports the script has it

from areal.api.reward_api import AsyncRewardWrapper

IS_TRAIN_SCRIPT = True


def script_reward(x=None):
    script = getattr(sys.modules.get("__mp_main__"), "IS_TRAIN_SCRIPT", False)
    return float(script) + 2.0 * float("torch" in sys.modules)


class Box:  # an argument whose class lives in the script
    pass


async def main():
    out = {}
    out["importable"] = await AsyncRewardWrapper("helper.worker_modules", max_workers=1)(1)
    out["script_fn"] = await AsyncRewardWrapper(script_reward, max_workers=1)(1)
    out["script_arg"] = await AsyncRewardWrapper("helper.worker_modules", max_workers=1)(Box())
    out["main_text"] = await AsyncRewardWrapper("helper.worker_modules", max_workers=1)(
        'if __name__ == "__main__":'
    )
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
    AsyncRewardWrapper.shutdown()
"""


def test_reward_workers_import_the_script_only_when_the_call_needs_it(tmp_path):
    """A reward function of an importable module runs in workers that never import the
    training script (nor its torch); a function or an argument defined in the script
    still works, in workers that import it."""
    import subprocess
    import sys

    (tmp_path / "helper.py").write_text(_HELPER)
    (tmp_path / "train_script.py").write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "train_script.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 0: neither the script nor torch; 3: both (the script imports torch). Text that
    # mentions __main__ (generated code) does not need the script.
    assert out == {"importable": 0.0, "script_fn": 3.0, "script_arg": 3.0, "main_text": 0.0}


async def test_async_reward_wrapper_inline_fast_path_first_pool_when_it_defers(wrapper_cleanup):
    """The fast path's answer is used without any worker pool; None, or an exception in
    the fast path, hands the call to the full function in a worker. gsm8k_reward_fn has
    one: a plain-number completion is scored without a pool."""
    AsyncRewardWrapper.shutdown()
    w = AsyncRewardWrapper(fast_pathed_reward, timeout_seconds=30, max_workers=1)
    assert await w(5) == 1.0
    assert AsyncRewardWrapper._pools == {}  # no worker started
    assert await w(-5) == 2.0  # deferred: the full function ran in a worker
    assert await w("raise") == 2.0
    assert len(AsyncRewardWrapper._pools) == 1
    assert w.stats() == {"n_calls": 3, "n_timeouts": 0, "n_errors": 0}
    AsyncRewardWrapper.shutdown()
    g = AsyncRewardWrapper(gsm8k_reward_fn, timeout_seconds=30, max_workers=1)
    assert await g("q", "so 3+4 = 7. #### 7", [], [], answer="7") == 1.0
    assert await g("q", "#### 8", [], [], answer="7") == 0.0
    assert AsyncRewardWrapper._pools == {}
