"""The real-model recipe benchmark's reading of a run and its verdicts
(``benchmarks/bench_real_model_recipe.py``): the bar was fixed before the runs it judges,
so what it reads from ``stats.jsonl`` and how it judges must be exactly what the docs say."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_real_model_recipe as recipe  # noqa: E402


def _stats(tmp_path: Path, evals: dict[int, float], step_s: float = 60.0) -> str:
    """A ``stats.jsonl`` as the trainer writes it: the evaluation before training at
    global step -1 (no training time), then one row per step with the running
    ``time/train_elapsed``, evaluations in the rows of global steps 4, 9, ..."""
    rows = [{"global_step": -1, "eval/accuracy": evals[0]}]
    for g in range(max(evals)):
        row = {"global_step": g, "time/train_step": step_s, "time/train_elapsed": (g + 1) * step_s}
        if g + 1 in evals:
            row["eval/accuracy"] = evals[g + 1]
        rows.append(row)
    path = tmp_path / "stats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_curve_maps_global_steps_to_steps_trained_and_minutes(tmp_path):
    pts = recipe.curve(_stats(tmp_path, {0: 0.4, 5: 0.5, 10: 0.7}, step_s=60.0))
    assert [p["step"] for p in pts] == [0, 5, 10]
    assert [p["minutes"] for p in pts] == [0.0, 5.0, 10.0]
    assert [p["accuracy"] for p in pts] == [0.4, 0.5, 0.7]


def test_seed_run_needs_15_points_within_45_minutes(tmp_path):
    # +15.6 points, but only after 50 minutes of training: not within the bar's time
    late = recipe.curve(_stats(tmp_path, {0: 0.4, 25: 0.45, 50: 0.556}, step_s=60.0))
    verdict = recipe.judge("seed2", late)
    assert verdict["best_gain_in_time"] == 0.05 and not verdict["met"]
    ok = recipe.curve(_stats(tmp_path, {0: 0.4, 10: 0.55, 20: 0.5}, step_s=60.0))
    assert recipe.judge("seed3", ok)["met"]  # the best evaluation within the time counts
    assert not recipe.judge("seed3", recipe.curve(_stats(tmp_path, {0: 0.4, 10: 0.549})))["met"]


def test_lora_needs_10_points_and_control_its_last_evaluation_within_5(tmp_path):
    assert recipe.judge("lora", recipe.curve(_stats(tmp_path, {0: 0.4, 5: 0.5})))["met"]
    assert not recipe.judge("lora", recipe.curve(_stats(tmp_path, {0: 0.4, 5: 0.49})))["met"]
    drift = recipe.curve(_stats(tmp_path, {0: 0.4, 5: 0.5, 10: 0.44}))
    verdict = recipe.judge("shuffled", drift)
    assert verdict["met"] and verdict["max_abs_drift"] == 0.1  # judged on the last one
    assert not recipe.judge("shuffled", recipe.curve(_stats(tmp_path, {0: 0.4, 5: 0.46})))["met"]


def test_runs_are_the_recipe_with_one_change_each():
    seed = recipe.command("seed3")
    assert seed[-1] == "seed=3" and recipe.CONFIG in seed
    shuffled = recipe.command("shuffled")
    assert shuffled[1:4] == [recipe.CONTROL, "--rewards", "shuffled"] and shuffled[-1] == "seed=1"
    lora = recipe.command("lora")
    assert "actor.use_lora=true" in lora and "actor.optimizer.lr=5e-5" in lora
