"""StatsLogger: every step's stats to JSON-lines, TensorBoard and (optionally) wandb,
SwanLab and Trackio (``stats_logger.swanlab.mode`` / ``stats_logger.trackio.mode``;
their local modes need no network: :mod:`areal.utils.trackers`).

Files under ``get_log_path(config)``: ``stats.jsonl`` (one JSON object per step),
``tensorboard/`` (unless ``tensorboard.path`` points elsewhere) and, at ``close()``, a
``curves.png`` plot of reward / accuracy / eval metrics against the step, with the
starts of run-health alarms (``health.jsonl``, ``areal.utils.run_health``) marked:
actionable ones as red lines, informational ones as grey dashed lines, rollbacks as
purple dotted lines.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

from areal.utils import logging

if TYPE_CHECKING:
    from areal.api.utils_config import StatsLoggerConfig

logger = logging.getLogger("StatsLogger")

# Keys plotted in curves.png when present (first match per panel).
_CURVE_PANELS = (
    ("reward (all rollouts)", ("rollout/reward", "rollout/reward/avg", "batch/reward")),
    ("held-out accuracy (step -1 = before RL)", ("eval/accuracy", "eval-rollout/reward")),
    ("loss", ("ppo_actor/update/actor_loss/avg", "sft/loss/avg", "loss")),
)


def get_log_path(config: Any) -> str:
    """``{fileroot}/logs/{experiment_name}/{trial_name}``: the run's log directory."""
    return os.path.join(
        str(config.fileroot), "logs", str(config.experiment_name), str(config.trial_name)
    )


class StatsLogger:
    """Writes step statistics; rank-0/controller only."""

    def __init__(self, config: StatsLoggerConfig, ft_spec: Any = None):
        self.config = config
        self.ft_spec = ft_spec
        self.log_path = get_log_path(config)
        os.makedirs(self.log_path, exist_ok=True)
        self.jsonl_path = os.path.join(self.log_path, "stats.jsonl")
        self._history: list[dict[str, float]] = []
        self._tb = None
        self._wandb = None
        self._trackers: list[Any] = []
        tb_path = config.tensorboard.path or os.path.join(self.log_path, "tensorboard")
        try:
            # FileWriter, not SummaryWriter: a step's scalars go as one event (commit)
            from torch.utils.tensorboard.writer import FileWriter

            self._tb = FileWriter(tb_path)
        except Exception as e:  # tensorboard is a core dependency; be loud but keep running
            logger.warning(f"TensorBoard disabled: {e}")
        wandb_cfg = config.wandb
        mode = wandb_cfg.mode
        if mode != "disabled":
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "stats_logger.wandb.mode != 'disabled' needs `pip install areal[wandb]`"
                ) from e
            self._wandb = wandb.init(
                mode=mode,
                project=wandb_cfg.project or str(config.experiment_name),
                name=wandb_cfg.name or str(config.trial_name),
                dir=self.log_path,
                resume="allow",
            )
        from areal.utils.trackers import SwanlabWriter, TrackioWriter

        names = (str(config.experiment_name), str(config.trial_name))
        if config.swanlab.mode not in (None, "disabled"):
            self._trackers.append(SwanlabWriter(config.swanlab, self.log_path, *names))
        if config.trackio.mode != "disabled":
            self._trackers.append(TrackioWriter(config.trackio, self.log_path, *names))

    @staticmethod
    def get_log_path(config: Any) -> str:
        return get_log_path(config)

    def commit(
        self,
        epoch: int,
        step: int,
        global_step: int,
        data: dict[str, float] | list[dict[str, float]],
    ):
        """Record the stats of one training step (a list is merged, later keys win)."""
        if isinstance(data, list):
            merged: dict[str, float] = {}
            for d in data:
                merged.update(d)
            data = merged
        row = {k: _to_float(v) for k, v in data.items()}
        row.update({"epoch": epoch, "epoch_step": step, "global_step": global_step})
        self._history.append(row)
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            # One event holding every scalar of the step: TensorBoard's writer checksums
            # each record in pure Python on a thread of its own, and one record per scalar
            # (~160 per step) cost the trainer's loop 60-80 ms per step in GIL hand-offs.
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [
                Summary.Value(tag=k, simple_value=v)
                for k, v in row.items()
                if isinstance(v, float) and math.isfinite(v)
            ]
            self._tb.add_summary(Summary(value=values), global_step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=global_step)
        for tracker in self._trackers:
            tracker.log(row, global_step)

    @property
    def history(self) -> list[dict[str, float]]:
        return list(self._history)

    def load_history(self) -> None:
        """Re-read ``stats.jsonl`` (after a resume) so the final curve covers the whole run."""
        if os.path.exists(self.jsonl_path):
            with open(self.jsonl_path) as f:
                self._history = [json.loads(line) for line in f if line.strip()]

    def plot_curves(self, path: str | None = None) -> str | None:
        """Write ``curves.png`` (reward, eval accuracy, loss against global step)."""
        if not self._history:
            return None
        # matplotlib's object API (no pyplot: its import and backend selection cost about
        # a second of CPU in every run's teardown); savefig renders with Agg
        from matplotlib.figure import Figure

        panels = []
        for title, keys in _CURVE_PANELS:
            for k in keys:
                pts = [(r["global_step"], r[k]) for r in self._history if k in r and _finite(r[k])]
                if pts:
                    panels.append((title, k, pts))
                    break
        if not panels:
            return None
        path = path or os.path.join(self.log_path, "curves.png")
        fig = Figure(figsize=(5 * len(panels), 3.5))
        axes = fig.subplots(1, len(panels), squeeze=False)
        marks = health_marks(os.path.join(self.log_path, "health.jsonl"))
        for ax, (title, key, pts) in zip(axes[0], panels, strict=True):
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
            for i, (x, label, style) in enumerate(marks):
                ax.axvline(x, **style)
                if ax is axes[0][0]:
                    ax.annotate(
                        label,
                        (x, 1.0),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        fontsize=6,
                        va="top",
                        ha="right",
                        color=style["color"],
                        xytext=(-1, -2 - 40 * (i % 2)),
                        textcoords="offset points",
                    )
            ax.set_title(f"{title}\n({key})", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path

    def close(self) -> str | None:
        png = self.plot_curves()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        return png

    def truncate_after(self, global_step: int) -> None:
        """After a resume: drop rows of steps later than ``global_step`` (they are redone)."""
        self.load_history()
        kept = [r for r in self._history if r.get("global_step", -1) <= global_step]
        if len(kept) != len(self._history):
            self._history = kept
            with open(self.jsonl_path, "w") as f:
                for row in kept:
                    f.write(json.dumps(row) + "\n")


_MARK_STYLES = {
    "actionable": {"color": "tab:red", "linestyle": "-", "linewidth": 1.0, "alpha": 0.8},
    "informational": {"color": "0.5", "linestyle": "--", "linewidth": 0.8, "alpha": 0.8},
    "rollback": {"color": "tab:purple", "linestyle": ":", "linewidth": 1.2, "alpha": 0.9},
}


def health_marks(path: str) -> list[tuple[int, str, dict[str, Any]]]:
    """``(step, label, line style)`` of every alarm start and rollback in ``health.jsonl``."""
    if not os.path.exists(path):
        return []
    marks = []
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "start":
                marks.append((e["step"], e["alarm"], _MARK_STYLES[e.get("kind", "actionable")]))
            elif e.get("event") == "rollback":
                marks.append((e["step"], f"rollback->{e['to_step']}", _MARK_STYLES["rollback"]))
    return marks


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
