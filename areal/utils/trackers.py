"""SwanLab and Trackio writers of :class:`areal.utils.stats_logger.StatsLogger`.

Both go through the real libraries. Locally (no network):

- SwanLab ``mode: offline`` (or ``local``) writes the run as one ``run-*.swanlab`` record
  file under ``stats_logger.swanlab.logdir`` (default ``{log_path}/swanlab``);
  ``swanlab sync DIR`` uploads it later. :func:`read_swanlab_scalars` reads it back.
- Trackio ``mode: local`` writes to Trackio's SQLite database in ``TRACKIO_DIR``. Trackio
  reads that variable once, when it is first imported: when it is unset then, the writer
  sets it to ``{log_path}/trackio``; ``trackio show --project NAME`` opens the dashboard.
  :func:`read_trackio_scalars` reads the metrics back.

Only finite numbers are sent (as for TensorBoard); ``stats.jsonl`` stays the record of
everything.
"""

from __future__ import annotations

import glob
import math
import os
from typing import Any

from areal.utils import logging

logger = logging.getLogger("StatsLogger")

# AReaL's SwanLab modes, and what swanlab 0.10 calls them
_SWANLAB_MODES = {
    "cloud": "online",
    "online": "online",
    "local": "local",
    "offline": "offline",
    "disabled": "disabled",
}


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, float) and math.isfinite(v)}


class SwanlabWriter:
    """One SwanLab run; ``log(row, step)`` per training step, ``close()`` at the end."""

    def __init__(self, cfg: Any, log_path: str, experiment_name: str, trial_name: str):
        mode = _SWANLAB_MODES.get(str(cfg.mode))
        if mode is None:
            raise ValueError(
                f"stats_logger.swanlab.mode={cfg.mode!r} is not one of {sorted(_SWANLAB_MODES)}"
            )
        import swanlab

        self.logdir = cfg.logdir or os.path.join(log_path, "swanlab")
        os.makedirs(self.logdir, exist_ok=True)
        if cfg.api_key and mode == "online":
            swanlab.login(api_key=cfg.api_key)
        self._run = swanlab.init(
            mode=mode,
            log_dir=self.logdir,
            project=cfg.project or experiment_name,
            name=cfg.name or trial_name,
            config=dict(cfg.config or {}),
            reinit=True,
        )
        logger.info(f"SwanLab run ({mode}) under {self.logdir}")

    def log(self, row: dict[str, Any], step: int) -> None:
        data = _scalars(row)
        if data:
            self._run.log(data, step=int(step))

    def close(self) -> None:
        import swanlab

        swanlab.finish()


class TrackioWriter:
    """One Trackio run (local SQLite storage, or a Space with ``space_id``)."""

    def __init__(self, cfg: Any, log_path: str, experiment_name: str, trial_name: str):
        if cfg.mode not in ("local", "online"):
            raise ValueError(
                f"stats_logger.trackio.mode={cfg.mode!r} is not one of ['local', 'online']"
            )
        if cfg.mode == "online" and not cfg.space_id:
            raise ValueError(
                "stats_logger.trackio.mode='online' needs stats_logger.trackio.space_id "
                "(a HuggingFace Space); use mode='local' for local storage"
            )
        os.environ.setdefault("TRACKIO_DIR", os.path.join(log_path, "trackio"))
        import trackio
        from trackio.utils import TRACKIO_DIR

        self.project = cfg.project or experiment_name
        self.name = cfg.name or trial_name
        self.storage_dir = str(TRACKIO_DIR)
        self._run = trackio.init(
            project=self.project,
            name=self.name,
            space_id=cfg.space_id if cfg.mode == "online" else None,
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
            resume="allow",
        )
        logger.info(f"Trackio run {self.project}/{self.name} ({cfg.mode}) in {self.storage_dir}")

    def log(self, row: dict[str, Any], step: int) -> None:
        data = _scalars(row)
        if data:
            self._run.log(data, step=int(step))

    def close(self) -> None:
        self._run.finish()


def read_swanlab_scalars(logdir: str) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}`` of the newest SwanLab run file under ``logdir``."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    files = sorted(glob.glob(os.path.join(logdir, "run-*", "*.swanlab")), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no SwanLab run file (run-*/*.swanlab) under {logdir!r}")
    out: dict[int, dict[str, float]] = {}
    reader = DataStoreReader()
    reader.open(files[-1])
    try:
        for raw in reader:
            rec = Record()
            rec.ParseFromString(raw)
            if rec.HasField("scalar"):
                s = rec.scalar
                out.setdefault(int(s.step), {})[s.key] = float(s.value.number)
    finally:
        reader.close()
    return out


def read_trackio_scalars(project: str, run: str) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}`` of a Trackio run, read from Trackio's local storage."""
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[int, dict[str, float]] = {}
    for entry in SQLiteStorage.get_logs(project, run, scalar_only=True):
        step = int(entry["step"])
        for k, v in entry.items():
            if k not in ("step", "timestamp") and isinstance(v, int | float):
                out.setdefault(step, {})[k] = float(v)
    return out
