"""The learning claims that README.md and docs/ state, as short seeded runs with thresholds.

Each :class:`Claim` names the figure as the README states it (the longer benchmark run),
the real entry point that produced it (an example script + its YAML, with overrides that
only shorten the run and give it its own output folder), the metric its output prints,
the threshold the short run must reach and the controls that must stay below it.

Runs are sized by training steps (never by seconds), so what they measure does not depend
on the machine's load. Thresholds were chosen from the measured short-run figures with a
margin (see ``docs/claims.json`` for the last measurement and the README's "Learning
claims" section); a control's ceiling is the same threshold: a control that reaches it
learnt without the reward signal, which means the claim's run does not show what it says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# Controls: how a control run differs from the claim's run.
#   ("wrap", MODE)   benchmarks/claims/reward_control.py --rewards MODE SCRIPT ...
#                    (each training batch's rewards permuted / made constant)
#   ("labels", ...)  benchmarks/claims/label_control.py SCRIPT ... (preference pairs: the
#                    training pairs' chosen/rejected swapped in a seeded random half)
#   ("args", [...])  extra arguments of the example script itself (its own control flag)
CONTROL_SCRIPT = "benchmarks/claims/reward_control.py"
LABEL_CONTROL_SCRIPT = "benchmarks/claims/label_control.py"
# How far a run's "before" may be from the claim's recorded ``base`` (absolute): the
# evaluation before training is greedy on a fixed base and held-out set, so it moves only
# with the evaluation code (or a broken one).
BASE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Control:
    name: str  # e.g. "shuffled rewards"
    kind: str  # "wrap" or "args"
    value: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    name: str
    stated: str  # the figure as README.md / docs state it (the longer run)
    reproduce: str  # the command of the longer run
    script: str
    config: str
    steps: int
    overrides: tuple[str, ...]
    metric: str  # what `measured` is
    parse: Callable[[str], tuple[float | None, float | None]]
    threshold: float
    controls: tuple[Control, ...] = field(default=())
    rl_overrides: bool = True  # the PPOTrainer overrides below apply
    # The claim whose "before" this one shares (same base model, evaluation code and
    # held-out set): its own run then skips the evaluation before training when that
    # claim runs too (with ``--only`` without it, it measures its own).
    before_from: str | None = None
    # The "before" figure recorded for this base (docs/claims.json): the judge fails a run
    # whose "before" is more than ``base_tolerance`` from it, or whose gain over its own
    # "before" is smaller than the gain the threshold asks of this base
    # (``threshold - base``). None: not checked.
    base: float | None = None
    base_tolerance: float = BASE_TOLERANCE

    def argv(self, run_dir: str, trial: str, control: bool = False) -> list[str]:
        """The example script's arguments for a run writing under ``run_dir``.

        A control run (``control``) skips the evaluation before training: it starts from
        the same base model with the same seed and held-out set as the claim's own run,
        whose "before" figure the table reports (or ``before_from``'s, which the runner
        passes as ``control=True`` for the claim's own run too).
        """
        common = [f"total_train_steps={self.steps}", f"cluster.fileroot={run_dir}"]
        common.append(f"trial_name={trial}")
        if self.rl_overrides:
            # one evaluation at the end (and one before, in the claim's own run);
            # no resume from an earlier run
            common += [f"evaluator.freq_steps={self.steps}", "recover.mode=disabled"]
            common += ["saver.freq_steps=null"]
            if control:
                common.append("evaluator.eval_before_train=false")
        return [self.script, "--config", self.config, *common, *self.overrides]


# ----------------------------------------------------------------------------- parsers
_FLOAT = r"([0-9]*\.[0-9]+)"


def before_after(before_re: str, after_re: str) -> Callable[[str], tuple]:
    def parse(out: str) -> tuple[float | None, float | None]:
        b = re.findall(before_re + r"\s*" + _FLOAT, out)
        a = re.findall(after_re + r"\s*" + _FLOAT, out)
        return (float(b[-1]) if b else None, float(a[-1]) if a else None)

    return parse


def json_line(key: str) -> Callable[[str], tuple]:
    """The alignment scripts print one JSON line with ``heldout_before`` / ``heldout_after``."""

    def parse(out: str) -> tuple[float | None, float | None]:
        for line in reversed(out.splitlines()):
            if line.startswith("{") and "heldout_after" in line:
                d = json.loads(line)
                return d["heldout_before"].get(key), d["heldout_after"].get(key)
        return None, None

    return parse


def tool_metric(key: str) -> Callable[[str], tuple]:
    """``tool_agent.py`` prints ``  KEY   before 0.363  after 0.570`` per metric."""

    def parse(out: str) -> tuple[float | None, float | None]:
        m = re.findall(rf"^\s+{key}\s+before\s+(\S+)\s+after\s+{_FLOAT}", out, re.M)
        if not m:
            return None, None
        b, a = m[-1]
        return (None if b == "-" else float(b)), float(a)

    return parse


ACCURACY = before_after(r"held-out accuracy before RL:", r"held-out accuracy after  RL:")
AGENT_ACCURACY = before_after(
    r"held-out greedy accuracy before RL:", r"held-out greedy accuracy after  RL:"
)
MT_SUCCESS = before_after(
    r"held-out success within \d+ turns before RL:", r"held-out success within \d+ turns after  RL:"
)

SHUFFLED = Control("shuffled rewards", "wrap", ("shuffled",))
SHUFFLED_LABELS = Control("shuffled labels", "labels", ())

# The first 256 problems of the demo's 512-problem held-out set (same generator and seed):
# the claims evaluated on it clear their thresholds by 15+ points and their controls stay
# 15+ points below (docs/claims.json), wider than the +-6-point 95% interval at n=256;
# halving the evaluations takes about a minute off `make claims`.
HELDOUT_256 = ("valid_dataset.path=synthetic://arith?digits=1&steps=2&n=256&seed=12345",)

# ----------------------------------------------------------------------------- claims
CLAIMS: tuple[Claim, ...] = (
    Claim(
        name="demo",
        base=0.215,
        stated="GRPO on tiny-base, held-out greedy 23.2% -> 97-98% (100 steps)",
        reproduce="make demo",
        script="examples/math/gsm8k_rl.py",
        config="examples/math/gsm8k_grpo_cpu.yaml",
        steps=4,
        overrides=HELDOUT_256,
        metric="held-out greedy accuracy (256)",
        parse=ACCURACY,
        threshold=0.70,
        controls=(SHUFFLED,),
    ),
    Claim(
        name="moe",
        base=0.246,
        stated="GRPO on tiny-moe at archon:d2e2 with routing replay, greedy 24.6% -> 87.5% "
        "(8 steps; shuffled 18.0-29.7%)",
        reproduce="python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_moe_cpu.yaml "
        "total_train_steps=8",
        script="examples/math/gsm8k_rl.py",
        config="examples/math/gsm8k_grpo_moe_cpu.yaml",
        steps=8,
        overrides=HELDOUT_256,
        metric="held-out greedy accuracy (256)",
        parse=ACCURACY,
        # the bar: 15 points above the base (24.6% on these 256), which the
        # shuffled control must not reach
        threshold=0.623,  # calibrated: 5 seeds, the midpoint (docs/claims.md)
        controls=(SHUFFLED,),
    ),
    Claim(
        name="proxy-agent",
        base=0.215,
        stated="openai-SDK agent through the proxy, 23.2% -> 94.7% (600 s; shuffled 35.9%)",
        reproduce="python examples/agent_workflow/math_agent.py "
        "--config examples/agent_workflow/agent_grpo_cpu.yaml",
        script="examples/agent_workflow/math_agent.py",
        config="examples/agent_workflow/agent_grpo_cpu.yaml",
        steps=4,
        overrides=HELDOUT_256,
        metric="held-out greedy accuracy (256)",
        parse=AGENT_ACCURACY,
        threshold=0.65,
        # the agent's greedy evaluation sends the demo's prompts to the same base: the
        # same figure as the demo's (23.2% / 21.5%) in every recorded run
        before_from="demo",
        controls=(Control("shuffled rewards", "args", ("+shuffle_rewards=true",)),),
    ),
    Claim(
        name="dpo",
        base=0.238,
        stated="DPO preference accuracy 23.8% -> 98.0% (60 steps)",
        reproduce="python examples/alignment/dpo.py --config examples/alignment/dpo_cpu.yaml",
        script="examples/alignment/dpo.py",
        config="examples/alignment/dpo_cpu.yaml",
        steps=15,
        overrides=(),
        metric="held-out preference accuracy (256 pairs)",
        parse=json_line("preference_accuracy"),
        threshold=0.738,  # calibrated: 5 seeds, the midpoint (docs/claims.md)
        rl_overrides=False,
        controls=(SHUFFLED_LABELS,),
    ),
    Claim(
        name="rw",
        base=0.473,
        stated="reward model pair accuracy 47.3% -> 93.4% (150 steps)",
        reproduce="python examples/alignment/rw.py --config examples/alignment/rw_cpu.yaml",
        script="examples/alignment/rw.py",
        config="examples/alignment/rw_cpu.yaml",
        steps=200,  # 100 and 150 left true runs and controls < 20 points apart (calibration)
        overrides=("evaluator.freq_steps=200",),  # held-out pairs before and after only
        metric="held-out pair accuracy (256 pairs)",
        parse=json_line("accuracy"),
        threshold=0.756,  # calibrated: 5 seeds at 200 steps, the midpoint (docs/claims.md)
        rl_overrides=False,
        # the value head starts from the seed: the "before" of another seed may be further
        # from 47.3% than the greedy evaluations' (to be narrowed by calibrate.py)
        base_tolerance=0.10,
        controls=(SHUFFLED_LABELS,),
    ),
    Claim(
        name="distillation",
        base=0.215,
        stated="pure on-policy distillation from teacher-rl40, greedy 23.2% -> 92.0% (30 steps)",
        reproduce="python examples/math/gsm8k_rl.py "
        "--config examples/distillation/gsm8k_grpo_distill_cpu.yaml",
        script="examples/math/gsm8k_rl.py",
        config="examples/distillation/gsm8k_grpo_distill_cpu.yaml",
        steps=6,
        overrides=HELDOUT_256,
        metric="held-out greedy accuracy (256)",
        parse=ACCURACY,
        threshold=0.511,  # calibrated: 5 seeds, the midpoint (docs/claims.md)
        # the control distils from the base itself: nothing to learn from the teacher
        before_from="demo",  # tiny-base, the same evaluator and held-out set
        controls=(
            Control("teacher = base", "args", ("teacher.path=areal/models/assets/tiny-base",)),
        ),
    ),
    Claim(
        name="lora",
        base=0.215,
        stated="GRPO with a LoRA adapter, greedy 23.2% -> 94.1% (30 steps)",
        reproduce="python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_lora.yaml",
        script="examples/math/gsm8k_rl.py",
        config="examples/math/gsm8k_grpo_lora.yaml",
        steps=4,
        overrides=HELDOUT_256,
        metric="held-out greedy accuracy (256)",
        parse=ACCURACY,
        threshold=0.565,  # calibrated: 5 seeds, the midpoint (docs/claims.md)
        before_from="demo",  # tiny-base, the same evaluator and held-out set
        controls=(SHUFFLED,),
    ),
    Claim(
        name="vlm",
        base=0.0,
        stated="tiny-vlm CLEVR counting, greedy 0% -> 100% (60 steps; shuffled/random 0%)",
        reproduce="python examples/vlm/clevr_count_grpo.py "
        "--config examples/vlm/clevr_count_grpo_cpu.yaml",
        script="examples/vlm/clevr_count_grpo.py",
        config="examples/vlm/clevr_count_grpo_cpu.yaml",
        steps=40,  # 20 left a true run at 9% against controls at 0% (calibration)
        overrides=(),
        metric="held-out greedy accuracy (256 scenes)",
        parse=ACCURACY,
        threshold=0.236,  # calibrated: 5 seeds at 40 steps, the midpoint (docs/claims.md)
        # shuffled rewards only: the random-rewards control (--random-rewards) stayed at 0%
        # beside it in every recorded run and cost a third of this claim's CPU; the longer
        # run of docs/customization/vlm.md measures both
        controls=(Control("shuffled rewards", "args", ("--shuffle-rewards",)),),
    ),
    Claim(
        name="tool-task",
        base=0.289,
        stated="necessary-tool task (A*B+C through a one-operation calculator, two calls), "
        "held-out greedy success 24.2% -> 72.7-89.1% (8 steps, 3 seeds; shuffled 24.6%)",
        reproduce="python benchmarks/bench_tool_task.py",
        script="examples/tool_task/train.py",
        config="examples/tool_task/config_cpu.yaml",
        steps=8,
        # the training problems of the measured short runs (seed 1); 128 held-out problems
        overrides=(
            "train_dataset.path=tool_arith://?n=20000&seed=1",
            "valid_dataset.path=tool_arith://?n=128&seed=0",
        ),
        metric="held-out greedy success (128)",
        parse=tool_metric("success"),
        # 15 points above the base (28.9% on these 128); at lr 3e-5 and 8 steps the true
        # runs are mid-climb (55-90%), so the margin is kept wide
        threshold=0.410,  # calibrated: 5 seeds, the midpoint (docs/claims.md)
        controls=(SHUFFLED,),
    ),
    Claim(
        name="multi-turn",
        base=0.262,
        stated="MultiTurnWorkflow, success within 2 turns 31.2% -> 67.2% (15 steps, 64 problems)",
        reproduce="python examples/multi_turn_math/gsm8k_rl_mt.py "
        "--config examples/multi_turn_math/gsm8k_grpo_mt_cpu.yaml total_train_steps=15 "
        "train_dataset.batch_size=8 rollout.max_concurrent_rollouts=16 "
        "'valid_dataset.path=synthetic://arith?digits=1&steps=2&n=64&seed=12345'",
        script="examples/multi_turn_math/gsm8k_rl_mt.py",
        config="examples/multi_turn_math/gsm8k_grpo_mt_cpu.yaml",
        steps=10,
        overrides=(),
        metric="held-out success within 2 turns (256)",
        parse=MT_SUCCESS,
        threshold=0.508,  # calibrated: 5 seeds, the midpoint (docs/claims.md)
        controls=(SHUFFLED,),
    ),
)

BY_NAME = {c.name: c for c in CLAIMS}
