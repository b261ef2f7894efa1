"""Reasoning Gym tasks as dataset paths (``reasoning_gym://``) and their reward.

The paths parse to the task's own config (typed, clear errors), splits other than
``train`` come from far-away seeds, the reward is the dataset's own ``score_answer``, and
the unmodified GSM8K example trains on a task (20 steps, held-out score rising) and on a
weighted mix of two tasks (3 steps) when only ``train_dataset.path`` changes.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from areal.api.cli_args import DatasetConfig
from areal.dataset import default_reward_fn, get_custom_dataset
from areal.dataset.reasoning_gym import (
    available_tasks,
    build_rg_dataset,
    parse_reasoning_gym_path,
)
from areal.reward.reasoning_gym import extract_rg_answer, reasoning_gym_reward_fn

REPO = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(REPO, "examples", "math", "gsm8k_rl.py")
DEMO_YAML = os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml")
# one-digit sums of two terms: the closest Reasoning Gym task to the tiny model's
# arithmetic word problems (it has never seen this prompt format)
CHAIN = "chain_sum?min_digits=1&max_digits=1&min_terms=2&max_terms=2"
MIX = (
    "reasoning_gym://chain_sum:3,basic_arithmetic:1?size={size}&seed=0"
    "&chain_sum.max_digits=1&chain_sum.max_terms=2&basic_arithmetic.max_digits=1"
    "&basic_arithmetic.max_terms=2&basic_arithmetic.operators=+,-"
    "&basic_arithmetic.allow_parentheses=false"
)


def rows(path: str, split: str = "train"):
    return list(get_custom_dataset(split, DatasetConfig(path=path, type="rl"), None))


def test_path_options_typed_and_canonical_path_round_trips():
    spec = parse_reasoning_gym_path(
        "reasoning_gym://basic_arithmetic?size=7&seed=3&max_terms=2&operators=+,-"
        "&allow_parentheses=false&format_style=natural"
    )
    opts = spec.task_options("basic_arithmetic")
    assert opts == {
        "max_terms": 2,
        "operators": ("+", "-"),  # '+' is the operator, not a space
        "allow_parentheses": False,
        "format_style": "natural",
    }
    assert (spec.size, spec.seed) == (7, 3)
    assert parse_reasoning_gym_path(spec.to_path()) == spec
    ds = build_rg_dataset(spec)
    assert len(ds) == 7 and ds.config.operators == ("+", "-")


def test_unknown_task_error_names_the_available_tasks():
    with pytest.raises(ValueError, match="unknown Reasoning Gym task 'chain_sums'") as e:
        rows("reasoning_gym://chain_sums?size=4")
    assert len(available_tasks()) > 100
    for task in ("chain_sum", "leg_counting", "basic_arithmetic", "zebra_puzzles"):
        assert repr(task) in str(e.value)


@pytest.mark.parametrize(
    "path, match",
    [
        ("reasoning_gym://chain_sum?digits=2", r"options: \['allow_negation', 'max_digits'"),
        ("reasoning_gym://chain_sum?max_terms=two", "must be an integer"),
        ("reasoning_gym://chain_sum?min_terms=5&max_terms=2", "max_terms must be >= min_terms"),
        ("reasoning_gym://chain_sum,leg_counting?max_terms=2", "names no task"),
        ("reasoning_gym://chain_sum:0,leg_counting?size=3", "must be > 0"),
        ("reasoning_gym://chain_sum?size=0", "size=0"),
        ("reasoning_gym://", "names no task"),
    ],
)
def test_bad_path_is_a_value_error_saying_what_is_allowed(path, match):
    with pytest.raises(ValueError, match=match):
        parse_reasoning_gym_path(path)


def test_type_other_than_rl_is_rejected():
    with pytest.raises(ValueError, match="RL rows only"):
        get_custom_dataset(
            "train", DatasetConfig(path=f"reasoning_gym://{CHAIN}", type="sft"), None
        )


def test_held_out_split_comes_from_a_far_seed_same_path():
    path = "reasoning_gym://basic_arithmetic?size=50&seed=0"
    train, test = rows(path, "train"), rows(path, "test")
    assert len(train) == len(test) == 50
    assert rows(path, "train") == train  # deterministic
    train_q = {r["messages"][0]["content"] for r in train}
    test_q = {r["messages"][0]["content"] for r in test}
    assert len(train_q & test_q) <= 2  # large problem space: independent draws
    test_seed = parse_reasoning_gym_path(test[0]["rg_dataset"]).seed
    assert abs(test_seed - 0) >= 10_000_000  # [seed, seed + size) ranges never overlap


def test_reward_is_the_tasks_score_answer_of_the_extracted_answer():
    for row in rows(f"reasoning_gym://{CHAIN}&size=20"):
        good = row["answer"]
        bad = str(int(good) + 1)
        args = (None, None, None)
        r = reasoning_gym_reward_fn(args[0], f"{good} #### {good}", *args[1:], **row)
        assert r == 1.0
        assert reasoning_gym_reward_fn(None, f"#### {bad}", None, None, **row) == 0.0
        assert reasoning_gym_reward_fn(None, f"<answer>{good}</answer>", None, None, **row) == 1.0
        assert reasoning_gym_reward_fn(None, "", None, None, **row) == 0.0
    # partial credit is the task's own: leg_counting's score_answer
    row = rows("reasoning_gym://leg_counting?size=3")[0]
    ds = build_rg_dataset(parse_reasoning_gym_path(row["rg_dataset"]))
    entry = ds[row["rg_index"]]
    for text in (row["answer"], "12", "many legs"):
        assert reasoning_gym_reward_fn(
            None, f"<answer>{text}</answer>", None, None, **row
        ) == ds.score_answer(text, entry)


def test_answer_extraction_order():
    assert extract_rg_answer("x <answer>a</answer> y <answer> b </answer>") == "b"
    assert extract_rg_answer("1 + 2 = 3\n#### 3") == "3"
    assert extract_rg_answer("so \\boxed{42}.") == "42"
    assert extract_rg_answer("  cat, dog \n") == "cat, dog"
    assert extract_rg_answer("  ") is None


def test_reward_refuses_rows_it_cannot_regenerate():
    row = rows(f"reasoning_gym://{CHAIN}&size=2")[0]
    with pytest.raises(ValueError, match="another reasoning-gym version"):
        reasoning_gym_reward_fn(None, "#### 1", None, None, **{**row, "answer": "nope"})
    with pytest.raises(ValueError, match="needs the rows' rg_dataset"):
        reasoning_gym_reward_fn(None, "#### 1", None, None, answer="1")


def test_mix_draws_tasks_by_weight_and_scores_each_with_its_own_task():
    mixed = rows(MIX.format(size=400))
    tasks = [r["task"] for r in mixed]
    n_chain = tasks.count("chain_sum")
    assert set(tasks) == {"chain_sum", "basic_arithmetic"}
    assert 0.65 < n_chain / len(tasks) < 0.85  # weight 3:1
    for row in mixed[:20]:
        assert reasoning_gym_reward_fn(None, f"#### {row['answer']}", None, None, **row) == 1.0
    assert default_reward_fn(MIX) == "areal.reward.reasoning_gym.reasoning_gym_reward_fn"
    assert default_reward_fn("synthetic://arith") == "areal.reward.gsm8k.gsm8k_reward_fn"


def _run_example(tmp_path, *overrides: str) -> tuple[list[dict], str]:
    """``examples/math/gsm8k_rl.py`` with the demo config, unchanged but for overrides."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, SCRIPT, "--config", DEMO_YAML,
        f"cluster.fileroot={tmp_path}", "recover.mode=disabled", *overrides,
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    (stats,) = glob.glob(os.path.join(str(tmp_path), "logs", "*", "*", "stats.jsonl"))
    with open(stats) as f:
        return [json.loads(line) for line in f if line.strip()], os.path.dirname(stats)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_trains_a_reasoning_gym_task_held_out_score_rises(tmp_path):
    """20 GRPO steps of the demo on chain_sum at lr 1e-4: the held-out (greedy) score rises.

    The tiny model never saw this prompt format: it starts at 10.9% (mostly numbers it
    copies from the prompt). At the demo's lr (5e-5) 20 steps were not enough to rely on
    (seeds 1-3 stood at 20.3%, 12.1% and 18.0% at step 20, one CI run at 10.5%); at
    1e-4, fixed before these runs, seeds 1-3 reached 19.1%, 19.1% and 18.8% in 20 steps.
    The assertion is only that the score rises."""
    stats, _ = _run_example(
        tmp_path,
        f"train_dataset.path=reasoning_gym://{CHAIN}&size=20000&seed=0",
        f"valid_dataset.path=reasoning_gym://{CHAIN}&size=256&seed=0",
        "total_train_steps=20",
        "evaluator.freq_steps=20",
        "actor.optimizer.lr=1.0e-4",
    )
    evals = [r["eval/accuracy"] for r in stats if "eval/accuracy" in r]
    assert len(evals) == 2, evals
    before, after = evals
    assert after > before, evals
    steps = [r for r in stats if "rollout/reward" in r]
    assert len(steps) == 20


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_trains_a_weighted_mix_of_two_tasks_rewards_are_their_score_answer(tmp_path):
    stats, log_dir = _run_example(
        tmp_path,
        f"train_dataset.path={MIX.format(size=64)}",
        "valid_dataset=null",
        "total_train_steps=3",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=24",
        "evaluator.eval_before_train=false",
        "actor.dynamic_sampling=false",
    )
    assert len([r for r in stats if "rollout/reward" in r]) == 3
    by_question = {r["messages"][0]["content"]: r for r in rows(MIX.format(size=64))}
    dumped = []
    for path in glob.glob(os.path.join(log_dir, "generated", "*.jsonl")):
        with open(path) as f:
            dumped += [json.loads(line) for line in f if line.strip()]
    assert len(dumped) >= 3 * 4 * 4
    tasks = set()
    for d in dumped:
        question = d["prompt"].split("user\n", 1)[1].rsplit("\nassistant", 1)[0]
        row = by_question[question]
        tasks.add(row["task"])
        ds = build_rg_dataset(parse_reasoning_gym_path(row["rg_dataset"]))
        entry = ds[row["rg_index"]]
        assert d["reward"] == ds.score_answer(extract_rg_answer(d["completion"]), entry)
    assert tasks == {"chain_sum", "basic_arithmetic"}
