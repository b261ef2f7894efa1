"""AReaL 2.0's losses and rollout options on the CPU demo: 20 steps each (JSON).

Runs ``examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_cpu.yaml`` with
overrides only, once per variant, one after the other, and reads the held-out greedy
accuracy (256 problems; the base model: about 23%) it prints after training. The bar of
AReaL 2.0's issue (fixed before these runs): at least 85% after 20 steps, each variant.
A learning run of every variant is minutes of both cores, so it is a benchmark, not a
test; the formulas are tested in tests/test_loss_variants.py, tests/test_turn_gae.py and
tests/test_group_options.py.

    .venv/bin/python benchmarks/bench_loss_demos.py [--variants cispo,kpop,...] [--out F]

``--out F``: the variants' results are merged into the JSON file F (one record per
variant, each with the commit, machine and load it ran under), as docs/loss_demos.json
is kept; the docs' headline table reads it (tools/render_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20
BAR = 0.85

VARIANTS = {
    "cispo": ["actor.use_cispo_loss=true", "actor.eps_clip=0.2", "actor.eps_clip_higher=0.28"],
    "kpop": ["actor.rejection_sampling.metric=binary_kl", "actor.rejection_sampling.upper=2.0"],
    "reuse_train_logp": ["actor.prox_logp_method=reuse_train_logp", "actor.ppo_n_minibatches=1"],
    "turn_gae": [
        "actor.gae_timestep_unit=turn",
        "actor.gae_lambda=areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae",
        "+actor.gae_lambda_kwargs.alpha=0.05",
        "actor.discount=0.99",
    ],
    "group_reward_normalization": ["gconfig.reward_normalization=true", "actor.reward_norm=null"],
    "drop_incomplete_group_warmup_steps": [
        "gconfig.drop_incomplete_group=true",
        "actor.optimizer.warmup_steps=2",
    ],
}


def run_demo(overrides: list[str], out: str) -> float:
    """Held-out accuracy after ``STEPS`` steps of the demo with ``overrides``."""
    cmd = [
        sys.executable, "examples/math/gsm8k_rl.py",
        "--config", "examples/math/gsm8k_grpo_cpu.yaml",
        f"total_train_steps={STEPS}", f"evaluator.freq_steps={STEPS}",
        "evaluator.eval_before_train=false", "recover.mode=disabled", "saver.freq_steps=null",
        f"cluster.fileroot={out}",
        "valid_dataset.path=synthetic://arith?digits=1&steps=2&n=256&seed=12345",
        *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    found = re.findall(r"held-out accuracy after  RL:\s*([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(
            f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return float(found[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="merge the results into this JSON file")
    args = ap.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    res: dict = {"steps": STEPS, "bar": BAR, "variants": {}}
    for name in [n for n in args.variants.split(",") if n]:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as out:
            acc = run_demo(VARIANTS[name], out)
        res["variants"][name] = {
            "overrides": VARIANTS[name], "held_out_accuracy": acc, "met": acc >= BAR,
            "wall_s": round(time.monotonic() - t0, 1), "commit": commit,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d"),
        }  # fmt: skip
        print(json.dumps({name: res["variants"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1))
    if args.out:
        merged = {"steps": STEPS, "bar": BAR, "variants": {}}
        if os.path.exists(args.out):
            with open(args.out) as f:
                merged = json.load(f)
        merged["variants"].update(res["variants"])
        merged["all_met"] = all(v["met"] for v in merged["variants"].values())
        with open(args.out, "w") as f:
            f.write(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
