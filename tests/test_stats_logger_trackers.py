"""SwanLab (offline) and Trackio (local) writers of StatsLogger: a run's metrics are read
back from each library's own local storage and equal ``stats.jsonl``."""

from __future__ import annotations

import json
import math
import os

import pytest

from areal.api.utils_config import StatsLoggerConfig, SwanlabConfig, TrackioConfig
from areal.utils.stats_logger import StatsLogger
from areal.utils.trackers import read_swanlab_scalars, read_trackio_scalars

ROWS = [
    {"rollout/reward": 0.25, "ppo_actor/update/actor_loss/avg": 1.5, "lr": 1e-5},
    {"rollout/reward": 0.5, "ppo_actor/update/actor_loss/avg": 1.25, "lr": 2e-5},
    {"rollout/reward": 0.75, "ppo_actor/update/actor_loss/avg": 1.0, "lr": float("nan")},
]


def _write_run(tmp_path, **trackers) -> tuple[StatsLogger, dict[int, dict[str, float]]]:
    cfg = StatsLoggerConfig(
        experiment_name="exp", trial_name="t1", fileroot=str(tmp_path), **trackers
    )
    cfg.tensorboard.path = str(tmp_path / "tb")
    sl = StatsLogger(cfg)
    for step, row in enumerate(ROWS):
        sl.commit(epoch=0, step=step, global_step=step, data=row)
    sl.close()
    with open(sl.jsonl_path) as f:
        rows = [json.loads(line) for line in f]
    expected = {
        r["global_step"]: {k: v for k, v in r.items() if isinstance(v, float) and math.isfinite(v)}
        for r in rows
    }
    return sl, expected


def test_swanlab_offline_run_read_back_equals_stats_jsonl(tmp_path):
    sl, expected = _write_run(tmp_path, swanlab=SwanlabConfig(mode="offline"))
    got = read_swanlab_scalars(os.path.join(sl.log_path, "swanlab"))
    assert got == expected
    assert "lr" not in got[2]  # NaN is not sent


def test_trackio_local_run_read_back_equals_stats_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    sl, expected = _write_run(tmp_path, trackio=TrackioConfig(mode="local", project="areal-test"))
    got = read_trackio_scalars("areal-test", "t1")
    assert {s: {k: got[s][k] for k in expected[s]} for s in got} == expected
    assert pytest.approx(got[1]["rollout/reward"]) == 0.5
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_project_db_path("areal-test").exists()


def test_trackers_bad_mode_raises_naming_field(tmp_path):
    with pytest.raises(ValueError, match="SwanlabConfig.mode='cloudy'"):
        SwanlabConfig(mode="cloudy")
    with pytest.raises(ValueError, match="space_id"):
        StatsLogger(
            StatsLoggerConfig(
                experiment_name="e",
                trial_name="t",
                fileroot=str(tmp_path),
                trackio=TrackioConfig(mode="online"),
            )
        )


def test_tensorboard_read_back_equals_stats_jsonl(tmp_path):
    """Each step's scalars are written as one TensorBoard event; TensorBoard's own reader
    gets every finite value of ``stats.jsonl`` back at its step (float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, expected = _write_run(tmp_path)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            got.setdefault(ev.step, {})[tag] = ev.value
    assert got.keys() == expected.keys()
    for step, row in expected.items():
        assert got[step] == pytest.approx(row, rel=1e-6)
    assert "lr" not in got[2]  # NaN is not written
