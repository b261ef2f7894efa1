"""The YAML-configured perf tracer on three demo steps, converted to Chrome trace-event
JSON by ``python -m areal.tools.perf_trace_converter``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal.tools.perf_trace_converter import convert_jsonl_to_chrome_trace
from areal.tools.trace_timeline import draw_timeline

SCOPES = {
    "trainer.rollout",
    "trainer.train_step",
    "trainer.update_weights",
    "timeperf.checkpoint_for_recover",
}


def test_converter_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "traces-r0.jsonl").write_text(
        '{"name": "a", "ph": "X", "ts": 1, "dur": 2}\n{oops\n'
    )
    with pytest.raises(ValueError, match=r"traces-r0.jsonl:2"):
        convert_jsonl_to_chrome_trace(tmp_path)
    with pytest.raises(FileNotFoundError):
        convert_jsonl_to_chrome_trace(tmp_path / "none")


@pytest.mark.slow
def test_perf_tracer_three_demo_steps_valid_chrome_trace(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    demo = [sys.executable, "-m", "areal.demo", "--steps", "3", "--eval-n", "8"]
    demo += ["--fileroot", str(tmp_path), "perf_tracer.enabled=true"]
    r = subprocess.run(demo, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    src = tmp_path / "logs" / "areal-demo" / "demo" / "perf_tracer"
    out = tmp_path / "trace.json"
    conv = [sys.executable, "-m", "areal.tools.perf_trace_converter", str(src), str(out)]
    r = subprocess.run(conv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    trace = json.loads(out.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
    for e in spans:
        assert isinstance(e["ts"], float | int) and isinstance(e["dur"], float | int), e
        assert e["dur"] >= 0
    ts = [e["ts"] for e in spans]
    assert ts == sorted(ts)
    names = [e["name"] for e in spans]
    assert SCOPES <= set(names)
    assert names.count("trainer.train_step") == 3
    # a step's phases lie inside its train_step span
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "trainer.train_step"
    )
    for e in spans:
        if e["name"] == "trainer.update_weights":
            assert any(a <= e["ts"] and e["ts"] + e["dur"] <= b + 1 for a, b in steps)
    assert [e["name"] for e in events if e["ph"] == "M"] == ["process_name"]
    # the project's own picture of it (no browser here)
    png = tmp_path / "timeline.png"
    drawn = draw_timeline(out, png)
    assert drawn["bars"] == len(spans)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_one_row_per_name_and_bad_input(tmp_path):
    trace = {
        "traceEvents": [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
            {"name": "trainer.train_step", "ph": "X", "ts": 0, "dur": 2_000_000, "pid": 0},
            {"name": "trainer.rollout", "ph": "X", "ts": 100, "dur": 500_000, "pid": 0},
            {"name": "trainer.train_step", "ph": "X", "ts": 2_000_000, "dur": 1_000_000, "pid": 0},
            {"name": "trainer.rollout", "ph": "X", "ts": 2_000_100, "dur": 0, "pid": 0},
        ]
    }
    src = tmp_path / "t.json"
    src.write_text(json.dumps(trace))
    drawn = draw_timeline(src, tmp_path / "a.png")
    assert drawn["rows"] == ["r0 trainer.train_step", "r0 trainer.rollout"]
    assert drawn["bars"] == 4 and abs(drawn["span_s"] - 3.0) < 1e-9
    only = draw_timeline(src, tmp_path / "b.png", names=["trainer.rollout"])
    assert only["rows"] == ["r0 trainer.rollout"] and only["bars"] == 2
    with pytest.raises(ValueError, match="no complete"):
        draw_timeline(src, tmp_path / "c.png", names=["nothing"])
    (tmp_path / "bad.json").write_text("{}")
    r = subprocess.run(
        [sys.executable, "-m", "areal.tools.trace_timeline", str(tmp_path / "bad.json"), "x.png"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no 'traceEvents' list" in r.stderr
