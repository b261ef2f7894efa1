"""Merge the perf tracer's per-rank JSONL files into one Chrome trace-event JSON file.

``python -m areal.tools.perf_trace_converter SRC_DIR OUT.json`` reads every ``*.jsonl``
file of ``SRC_DIR`` (the trainer writes ``{log_dir}/perf_tracer/traces-r{rank}.jsonl``
when ``perf_tracer.enabled``), sorts the events by time, names each process after its
rank (``process_name`` metadata events) and writes ``{"traceEvents": [...],
"displayTimeUnit": "ms"}``, the format ``chrome://tracing`` and Perfetto open.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

_REQUIRED = ("name", "ph", "ts")


def _read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
            if not isinstance(ev, dict) or any(k not in ev for k in _REQUIRED):
                raise ValueError(f"{path}:{lineno}: a trace event needs the keys {_REQUIRED}")
            events.append(ev)
    return events


def convert_jsonl_to_chrome_trace(
    src_dir: str | os.PathLike, out_path: str | os.PathLike | None = None
) -> dict[str, Any]:
    """The merged trace of ``src_dir``'s ``*.jsonl`` files; written to ``out_path`` when
    given. Raises ``FileNotFoundError`` when ``src_dir`` holds no such file and
    ``ValueError`` naming file and line for a line that is not a trace event."""
    src = Path(src_dir)
    files = sorted(src.glob("*.jsonl")) if src.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.jsonl trace files in {str(src)!r}")
    events: list[dict[str, Any]] = []
    for path in files:
        for ev in _read_events(path):
            ev.setdefault("pid", 0)
            ev.setdefault("tid", 0)
            events.append(ev)
    events.sort(key=lambda e: (e["ts"], -float(e.get("dur", 0))))
    pids = sorted({int(e["pid"]) for e in events})
    meta = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}}
        for pid in pids
    ]
    trace = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if out_path is not None:
        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(trace), encoding="utf-8")
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.tools.perf_trace_converter", description=__doc__.splitlines()[0]
    )
    parser.add_argument("src_dir", help="directory of the per-rank traces-r*.jsonl files")
    parser.add_argument("out", help="the Chrome trace-event JSON file to write")
    args = parser.parse_args(argv)
    try:
        trace = convert_jsonl_to_chrome_trace(args.src_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    sys.stdout.write(f"{n} events -> {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
