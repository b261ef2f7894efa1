"""The necessary-tool task over several seeds, with a shuffled-reward control: one JSON.

    .venv/bin/python benchmarks/bench_tool_task.py                 # seeds 1,2,3 + control
    .venv/bin/python benchmarks/bench_tool_task.py --seeds 1 --steps 10 --no-control

What happens, in order:

1. For each seed, ``examples/tool_task/train.py --config examples/tool_task/config_cpu.yaml``
   runs as a subprocess with ``seed=S`` and the training problems of seed S
   (``train_dataset.path=tool_arith://?n=20000&seed=S``), ``--steps`` training steps (capped
   at ``--max-seconds`` of training), its own output folder; the held-out set is always the
   base's own (256 problems, ``tool_arith://?n=256&seed=0``, split ``test``), evaluated
   greedily before and after training.
2. Unless ``--no-control``: the same run for the first seed through
   ``benchmarks/claims/reward_control.py --rewards shuffled`` (each training batch's rewards
   permuted: no link between an episode and its reward), without the evaluation before.
3. Each run's printed ``success before X after Y`` is parsed; its wall time and CPU time
   (the whole process tree, ``os.wait4``) recorded. One JSON object is printed: per seed
   base, after, gain (points), steps, wall and CPU seconds; the control's after and its
   distance from the base; ``pass`` (every seed >= 15 points above its base within 15
   minutes, the control within 5 points of the base).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/tool_task/train.py"
CONFIG = "examples/tool_task/config_cpu.yaml"
CONTROL = "benchmarks/claims/reward_control.py"
_FIG = re.compile(r"^\s+(\w+)\s+before\s+(\S+)\s+after\s+([0-9.]+)", re.M)


def run(label: str, argv: list[str], out: Path, timeout: float) -> dict:
    log = out / f"{label}.log"
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT
        )
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
    wall = time.time() - t0
    text = log.read_text(errors="replace")
    figs = {m[0]: (None if m[1] == "-" else float(m[1]), float(m[2])) for m in _FIG.findall(text)}
    steps = re.findall(r"over \d+ problems \((\d+) steps, (\d+) s of training", text)
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "steps": int(steps[-1][0]) if steps else None,
        "train_s": int(steps[-1][1]) if steps else None,
        "before": figs.get("success", (None, None))[0],
        "after": figs.get("success", (None, None))[1],
        "tool_called_after": figs.get("tool_called", (None, None))[1],
        "log": str(log),
        "timed_out": wall > timeout,
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-seconds", type=float, default=720.0, help="training time cap per run")
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument("--no-control", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_tool_task")
    args = ap.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    limit = 15 * 60

    def argv_of(seed: int, label: str, control: bool) -> list[str]:
        a = [
            SCRIPT,
            "--config",
            CONFIG,
            f"seed={seed}",
            f"train_dataset.path=tool_arith://?n=20000&seed={seed}",
            f"valid_dataset.path=tool_arith://?n={args.n_eval}&seed=0",
            f"total_train_steps={args.steps}",
            f"cluster.fileroot={args.out / label}",
            f"trial_name={label}",
            f"+max_seconds={args.max_seconds}",
        ]
        if control:
            a = [CONTROL, "--rewards", "shuffled", *a, "evaluator.eval_before_train=false"]
        return a

    t0 = time.time()
    runs = {}
    for s in seeds:
        runs[f"seed{s}"] = run(f"seed{s}", argv_of(s, f"seed{s}", False), args.out, limit)
        print(json.dumps({f"seed{s}": runs[f"seed{s}"]}), file=sys.stderr, flush=True)
    base = runs[f"seed{seeds[0]}"]["before"]
    control = None
    if not args.no_control:
        control = run("shuffled", argv_of(seeds[0], "shuffled", True), args.out, limit)
        control["before"] = base
        if base is not None and control["after"] is not None:
            control["distance_from_base_points"] = round(100 * (control["after"] - base), 1)
    for r in runs.values():
        if r["before"] is not None and r["after"] is not None:
            r["gain_points"] = round(100 * (r["after"] - r["before"]), 1)
    ok = all(r.get("gain_points", -1) >= 15 and r["wall_s"] <= limit for r in runs.values())
    if control is not None:
        ok = ok and abs(control.get("distance_from_base_points", 99)) <= 5
    result = {
        "task": "A * B + C through a one-operation calculator (examples/tool_task)",
        "base": base,
        "runs": runs,
        "shuffled_control": control,
        "steps": args.steps,
        "n_eval": args.n_eval,
        "total_wall_s": round(time.time() - t0, 1),
        "pass": ok,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
