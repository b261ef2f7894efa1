"""Held-out accuracy vs wall-clock of VLM demo runs (the run and its controls).

    python examples/vlm/plot_curves.py out.png "true rewards=RUN_LOG_DIR" \
        "shuffled rewards=LOG_DIR2" "random rewards=LOG_DIR3"

Each LOG_DIR is a trainer log directory holding ``stats.jsonl`` (``eval/accuracy`` rows,
``time/elapsed``). Prints the points as JSON.
"""

import json
import os
import sys


def eval_points(log_dir: str) -> list[tuple[int, float, float]]:
    """(step, seconds since start, accuracy) of every evaluation in ``log_dir``."""
    rows = [json.loads(x) for x in open(os.path.join(log_dir, "stats.jsonl")) if x.strip()]
    points, elapsed = [], 0.0
    for r in rows:
        elapsed = r.get("time/elapsed", elapsed)
        if "eval/accuracy" in r:
            step = r.get("global_step", -1) + 1  # an eval row after step k has global_step k
            points.append((step, elapsed if step > 0 else 0.0, r["eval/accuracy"]))
    return points


def main(argv):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = argv[0], [a.split("=", 1) for a in argv[1:]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    result = {}
    markers = ["o", "s", "^", "v", "x", "d"]  # controls often overlap (all at 0%)
    for i, (name, d) in enumerate(runs):
        pts = eval_points(d)
        result[name] = pts
        xs, ys = [p[1] / 60 for p in pts], [100 * p[2] for p in pts]
        ax.plot(xs, ys, marker=markers[i % len(markers)], markerfacecolor="none", label=name)
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("GRPO on the tiny VLM, synthetic CLEVR counting (CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
