"""Speed of ``gsm8k_reward_fn`` on the vendored GSM8K test split (a rate, not a test).

Scores every gold solution against itself and an off-by-one copy (2 x 1,319 calls), the
workload ``tests/test_reward.py`` checks for correctness, ``--repeats`` times, and prints
JSON: calls, seconds, calls per second (best and median repeat) and how many scores were
wrong (must be 0). It replaces the wall-clock bound the test used to carry (5 s for the
2,638 calls): a bound on seconds belongs here, where nothing runs beside it.

    .venv/bin/python benchmarks/bench_reward.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from areal.reward.gsm8k import gsm8k_reward_fn

GSM8K_TEST = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k" / "test.jsonl"


def workload() -> list[tuple[str, str, float]]:
    """(completion, answer, expected reward) for every gold solution and its N+1 copy."""
    rows = [json.loads(ln) for ln in GSM8K_TEST.read_text().splitlines() if ln.strip()]
    out = []
    for row in rows:
        sol = row["answer"]
        body, final = sol.rsplit("####", 1)
        value = float(final.strip().replace(",", ""))
        bumped = f"{value + 1:g}" if value != int(value) else f"{int(value) + 1}"
        out += [(sol, sol, 1.0), (body + "#### " + bumped, sol, 0.0)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    calls = workload()
    times, wrong = [], 0
    for _ in range(ns.repeats):
        t0 = time.perf_counter()
        wrong = sum(gsm8k_reward_fn("q", c, [], [], a) != want for c, a, want in calls)
        times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "calls": len(calls),
                "repeats": ns.repeats,
                "seconds_best": round(min(times), 4),
                "seconds_median": round(statistics.median(times), 4),
                "calls_per_s_best": round(len(calls) / min(times), 1),
                "calls_per_s_median": round(len(calls) / statistics.median(times), 1),
                "wrong": wrong,
            }
        )
    )


if __name__ == "__main__":
    main()
