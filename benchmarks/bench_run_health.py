"""Run health on the unmodified demo: which alarms a healthy run raises (JSON).

    nice -n 10 .venv/bin/python benchmarks/bench_run_health.py              # 100 steps x 3 seeds
    .venv/bin/python benchmarks/bench_run_health.py --steps 30 --seeds 1    # a quicker look

Each seed runs ``python -m areal.demo --steps N`` (the demo's configuration, only ``seed``
changed) in its own process and output folder, then reads its ``health.jsonl``. The
issue's criterion: no *actionable* alarm on any seed (informational ones, reward
saturation and groups without signal, are what a converging run reaches). Prints one JSON
object: per seed the alarms started (step, kind, value, threshold), the wall time and the
held-out accuracy before/after; ``ok`` is true when no actionable alarm started.
About 8-10 minutes per seed of 100 steps on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_seed(seed: int, steps: int, eval_n: int, root: str) -> dict:
    fileroot = os.path.join(root, f"seed{seed}")
    cmd = [
        sys.executable,
        "-m",
        "areal.demo",
        f"--steps={steps}",
        f"--eval-n={eval_n}",
        f"--fileroot={fileroot}",
        f"seed={seed}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    log_dir = os.path.join(fileroot, "logs", "areal-demo", "demo")
    events = []
    path = os.path.join(log_dir, "health.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            events = [json.loads(line) for line in f if line.strip()]
    acc = {}
    for line in proc.stdout.splitlines():
        if line.startswith("held-out accuracy before RL:"):
            acc["before"] = float(line.split(":")[1].split()[0])
        elif line.startswith("held-out accuracy after"):
            acc["after"] = float(line.split(":")[1].split()[0])
    return {
        "seed": seed,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "heldout_accuracy": acc,
        "alarms": [
            {
                k: e.get(k)
                for k in ("event", "alarm", "kind", "step", "value", "threshold", "detail")
            }
            for e in events
            if e["event"] in ("start", "clear")
        ],
        "actionable_started": sorted(
            {e["alarm"] for e in events if e["event"] == "start" and e["kind"] == "actionable"}
        ),
        "stderr_tail": proc.stderr[-2000:] if proc.returncode else "",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N (the demo's is 1)")
    p.add_argument("--seed", type=int, action="append", help="these seeds instead of 1..N")
    p.add_argument("--eval-n", type=int, default=512)
    p.add_argument("--root", default=None, help="output folder (default: a temporary one)")
    args = p.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="bench-run-health-")
    seeds = args.seed or list(range(1, args.seeds + 1))
    runs = [run_seed(s, args.steps, args.eval_n, root) for s in seeds]
    out = {
        "benchmark": "run_health_unmodified_demo",
        "steps": args.steps,
        "seeds": [r["seed"] for r in runs],
        "ok": all(r["returncode"] == 0 and not r["actionable_started"] for r in runs),
        "runs": runs,
        "root": root,
    }
    sys.stdout.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
