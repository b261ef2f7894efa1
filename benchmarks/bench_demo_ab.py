"""The demo's trained samples/s at two commits, in interleaved runs (a refactor's check).

    python benchmarks/bench_demo_ab.py --before 4c14d19 --after HEAD [--runs 3] [--steps 40]

Checks out both commits into temporary git worktrees and runs the CPU demo
(``examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_cpu.yaml``) from each,
alternating before / after ``--runs`` times, with this checkout's ``.venv`` and
``PYTHONPATH`` set to the worktree (each run prints which ``areal`` it imported). A run
trains ``--steps`` steps without evaluation; its figure is trained samples per second of
training wall time (``time/train_elapsed`` of its last step in ``stats.jsonl``: batch
size x samples per prompt x steps, over that time). It prints JSON: every run, the median
of each side, their ratio (after / before) and the spread of each side ((max - min) /
median), so a difference can be read against the run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "examples/math/gsm8k_grpo_cpu.yaml"


def _worktree(ref: str, root: str) -> tuple[str, str]:
    sha = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    path = os.path.join(root, sha)
    subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "--detach", path, sha],
        check=True,
        capture_output=True,
    )
    return sha, path


def _run(tree: str, steps: int, fileroot: str, tag: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-c",
        "import areal, runpy, sys; print('areal from', areal.__file__, flush=True); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
        os.path.join(tree, "examples/math/gsm8k_rl.py"),
        "--config",
        os.path.join(tree, CONFIG),
        f"total_train_steps={steps}",
        f"cluster.fileroot={fileroot}",
        f"trial_name={tag}",
        "evaluator.freq_steps=null",
        "evaluator.eval_before_train=false",
    ]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    origin = next((ln for ln in out.stdout.splitlines() if ln.startswith("areal from")), "")
    if out.returncode != 0 or not origin.startswith(f"areal from {tree}"):
        raise RuntimeError(
            f"run {tag} failed (rc {out.returncode}, {origin!r}):\n{out.stderr[-3000:]}"
        )
    stats_files = [
        os.path.join(d, f)
        for d, _, files in os.walk(fileroot)
        for f in files
        if f == "stats.jsonl" and tag in d
    ]
    rows = [json.loads(ln) for ln in open(stats_files[0]) if ln.strip()]
    rows = [r for r in rows if r.get("global_step", 0) >= 0 and "time/train_elapsed" in r]
    last = rows[-1]
    samples = len(rows) * 16 * 8  # train_dataset.batch_size x gconfig.n_samples (the demo's)
    return {
        "tag": tag,
        "steps": len(rows),
        "train_seconds": round(last["time/train_elapsed"], 2),
        "wall_seconds": round(wall, 1),
        "samples_per_s": round(samples / last["time/train_elapsed"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="demo-ab-")
    trees = {}
    try:
        for side, ref in (("before", args.before), ("after", args.after)):
            trees[side] = _worktree(ref, root)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for i in range(args.runs):
            for side in ("before", "after"):
                sha, tree = trees[side]
                r = _run(tree, args.steps, os.path.join(root, "out"), f"{side}-{sha}-{i}")
                runs[side].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        summary = {}
        for side in runs:
            v = [r["samples_per_s"] for r in runs[side]]
            med = statistics.median(v)
            summary[side] = {
                "commit": trees[side][0],
                "median_samples_per_s": med,
                "spread": round((max(v) - min(v)) / med, 3),
            }
        ratio = summary["after"]["median_samples_per_s"] / summary["before"]["median_samples_per_s"]
        print(
            json.dumps(
                {"runs": runs, "summary": summary, "ratio_after_over_before": round(ratio, 3)},
                indent=1,
            )
        )
    finally:
        for _, tree in trees.values():
            subprocess.run(
                ["git", "-C", REPO, "worktree", "remove", "--force", tree], capture_output=True
            )


if __name__ == "__main__":
    main()
