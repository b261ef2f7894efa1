"""Draw a Chrome trace-event file as a timeline picture (PNG), for machines without a browser.

``python -m areal.tools.trace_timeline TRACE.json OUT.png [--names PREFIX ...]``

1. Reads the ``traceEvents`` of ``TRACE.json`` (as written by
   ``python -m areal.tools.perf_trace_converter``) and keeps the complete events
   (``ph: "X"``), optionally only those whose name starts with one of ``--names``.
2. Gives every span name one row, per process (rank), ordered by the first start of the
   name, so nested phases (``trainer.train_step`` and the phases inside it) sit on
   separate rows.
3. Draws one bar per event from its start to its end, seconds from the first event, with
   the median duration of each name in its row label, and writes the PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _complete_events(trace: dict[str, Any], names: list[str] | None) -> list[dict[str, Any]]:
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a trace-event file: no 'traceEvents' list")
    keep = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    if names:
        keep = [e for e in keep if any(str(e.get("name", "")).startswith(p) for p in names)]
    if not keep:
        raise ValueError("the trace holds no complete ('X') events to draw")
    return keep


def draw_timeline(
    trace_path: str | Path, out_path: str | Path, names: list[str] | None = None
) -> dict[str, Any]:
    """Write ``out_path`` (PNG) from the trace at ``trace_path``; returns what was drawn:
    ``rows`` (row labels, top to bottom), ``bars`` (number of bars) and ``span_s``."""
    # matplotlib's object API: no pyplot, no global backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    trace = json.loads(Path(trace_path).read_text(encoding="utf-8"))
    events = _complete_events(trace, names)
    t0 = min(float(e["ts"]) for e in events)
    first: dict[tuple[int, str], float] = {}
    durs: dict[tuple[int, str], list[float]] = {}
    for e in events:
        key = (int(e.get("pid", 0)), str(e["name"]))
        first[key] = min(first.get(key, float("inf")), float(e["ts"]))
        durs.setdefault(key, []).append(float(e.get("dur", 0.0)) / 1e6)
    keys = sorted(first, key=lambda k: (k[0], first[k]))
    row = {k: i for i, k in enumerate(keys)}
    end = max((float(e["ts"]) + float(e.get("dur", 0.0)) - t0) / 1e6 for e in events)

    fig = Figure(figsize=(11, 0.45 * len(keys) + 1.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = [f"C{i % 10}" for i in range(len(keys))]
    for e in events:
        key = (int(e.get("pid", 0)), str(e["name"]))
        start = (float(e["ts"]) - t0) / 1e6
        width = max(float(e.get("dur", 0.0)) / 1e6, end * 1e-3)  # a zero-length span stays visible
        ax.broken_barh(
            [(start, width)], (row[key] - 0.4, 0.8), color=colours[row[key]], edgecolor="white"
        )
    labels = [
        f"r{pid} {name} (median {statistics.median(durs[(pid, name)]):.2f}s)" for pid, name in keys
    ]
    ax.set_yticks(range(len(keys)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds from the first span")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{len(events)} spans, {end:.1f} s")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return {"rows": [f"r{p} {n}" for p, n in keys], "bars": len(events), "span_s": end}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.tools.trace_timeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("trace", help="a Chrome trace-event JSON file")
    parser.add_argument("out", help="the PNG file to write")
    parser.add_argument(
        "--names", nargs="*", default=None, help="draw only spans whose name starts so"
    )
    args = parser.parse_args(argv)
    try:
        drawn = draw_timeline(args.trace, args.out, args.names)
    except (OSError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    sys.stdout.write(f"{drawn['bars']} spans on {len(drawn['rows'])} rows -> {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
