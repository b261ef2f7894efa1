"""Run health: alarms on the statistics of every training step (``run_health`` config,
``areal.api.health_config.RunHealthConfig``; docs/run_health.md).

``RunHealthMonitor.observe(step, stats)`` is called by the trainer once per step, after
the update and before that step's recover checkpoint, with the step's statistics (the
ones ``stats.jsonl`` gets, plus the batch signals of :func:`batch_signals`). It runs the
detectors of ``areal.utils.health_detectors`` on the recent history of their signals and
keeps one state per alarm: an alarm *starts* on the first step its condition holds and
*clears* after ``clear_steps`` consecutive steps without it. Each start and clear is one
line of ``{log_dir}/health.jsonl`` (step, alarm, kind, metric, value, threshold, the recent
values, a suggested action) and one log line; every step's stats get ``health/<alarm>``
(1.0 while active) and ``health/actionable_active``, so stats.jsonl, TensorBoard and wandb
show them, and ``curves.png`` marks the starts (``areal.utils.stats_logger``).

Alarms are *actionable* (``ACTIONABLE_ALARMS``: collapse, blow-ups, mismatch, divergence,
hacking) or *informational* (``reward_saturation``, ``no_signal_groups``: a converging run
reaches them normally; ``truncation_high``: a setting to change, logged as a WARNING,
``WARNING_ALARMS``). The start of an actionable alarm returns its action
(``RunHealthConfig.action_for``): ``warn``, ``stop`` or ``rollback``; the trainer carries it
out (``areal.trainer.health_rollback``) and reports a rollback back through
:meth:`RunHealthMonitor.rolled_back`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from areal.api.health_config import ACTIONABLE_ALARMS, ALARMS, WARNING_ALARMS
from areal.utils import logging
from areal.utils.health_detectors import DETECTORS, Finding, SignalHistory, signals_from_stats

if TYPE_CHECKING:
    from areal.api.health_config import RunHealthConfig

logger = logging.getLogger("RunHealth")

HEALTH_FILE = "health.jsonl"
_SEVERITY = {"warn": 0, "stop": 1, "rollback": 2}


@dataclass
class _AlarmState:
    active: bool = False
    start_step: int | None = None
    healthy_streak: int = 0


@dataclass
class HealthReport:
    """What one ``observe`` found: events written, stats to log, the action to take."""

    events: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    action: str = "warn"  # the most severe action among the actionable starts
    trigger: dict[str, Any] | None = None  # the start event that asks for ``action``


def batch_signals(
    batch: dict[str, torch.Tensor], group_size: int, n_filtered_groups: int = 0
) -> dict[str, float]:
    """Signals only the consumed batch has: ``health/signal/no_signal_share`` (groups whose
    rewards are all equal, counting ``n_filtered_groups`` the dynamic filter dropped since
    the last batch), ``health/signal/reward_length_corr`` (Pearson correlation of reward
    and response length over the batch; absent when either is constant) and
    ``health/signal/truncation`` (share of rows with ``no_eos``, when the batch has it)."""
    out: dict[str, float] = {}
    rewards = batch["rewards"].float().reshape(-1)
    n = rewards.numel()
    if n == 0:
        return out
    if "group_ids" in batch:
        _, gid = torch.unique(batch["group_ids"].reshape(-1), return_inverse=True)
    else:
        gid = torch.arange(n) // max(1, int(group_size))
    n_groups = int(gid.max()) + 1
    gmax = torch.full((n_groups,), -torch.inf).scatter_reduce(0, gid, rewards, "amax")
    gmin = torch.full((n_groups,), torch.inf).scatter_reduce(0, gid, rewards, "amin")
    flat = int(((gmax - gmin).abs() <= 1e-6).sum())
    total = n_groups + max(0, int(n_filtered_groups))
    out["health/signal/no_signal_share"] = (flat + max(0, int(n_filtered_groups))) / total
    lengths = batch["loss_mask"].float().sum(-1).reshape(-1)
    if n > 2:
        r, ln = rewards - rewards.mean(), lengths - lengths.mean()
        denom = float(r.norm() * ln.norm())
        if denom > 1e-9:
            out["health/signal/reward_length_corr"] = float((r * ln).sum()) / denom
    if "no_eos" in batch:
        out["health/signal/truncation"] = float(batch["no_eos"].float().mean())
    return out


class RunHealthMonitor:
    """The alarm states of one run (module docstring)."""

    def __init__(self, config: RunHealthConfig, log_dir: str | None = None):
        self.config = config
        self.path = os.path.join(log_dir, HEALTH_FILE) if log_dir else None
        self.history = SignalHistory()
        self.states = {d.name: _AlarmState() for d in DETECTORS}
        self.rollbacks = 0
        self.events: list[dict[str, Any]] = []  # every event of this monitor's life

    # ------------------------------------------------------------------ inputs
    def add_eval(self, step: int, eval_stats: dict[str, Any]) -> None:
        """Record a held-out evaluation (judged at the next ``observe``)."""
        sig = signals_from_stats(eval_stats)
        for name in ("heldout", "heldout_n"):
            if name in sig:
                self.history.add(step, name, sig[name])

    def observe(self, step: int, stats: dict[str, Any], quiet: bool = False) -> HealthReport:
        """Judge step ``step``; ``quiet``: rebuild state only (no file, no log, no action)."""
        report = HealthReport()
        if not self.config.enabled:
            return report
        for name, v in signals_from_stats(stats, self.config.verifier_key).items():
            if name in ("heldout", "heldout_n"):
                continue  # add_eval records evaluations (an eval row is not a train step)
            self.history.add(step, name, v)
        for det in DETECTORS:
            finding = det.fn(self.history, self.config)
            state = self.states[det.name]
            if finding is None:
                continue
            if finding.firing:
                state.healthy_streak = 0
                if not state.active:
                    state.active, state.start_step = True, step
                    report.events.append(self._event("start", det, step, finding))
            elif state.active:
                state.healthy_streak += 1
                if state.healthy_streak >= self.config.clear_steps:
                    report.events.append(self._event("clear", det, step, finding))
                    state.active, state.start_step, state.healthy_streak = False, None, 0
        report.stats = self.step_stats()
        if quiet:
            return report
        self._emit(report.events)
        for e in report.events:
            if e["event"] == "start" and e["kind"] == "actionable":
                if _SEVERITY[e["action"]] > _SEVERITY[report.action]:
                    report.action, report.trigger = e["action"], e
                elif report.trigger is None:
                    report.trigger = e
        return report

    def step_stats(self) -> dict[str, float]:
        out = {f"health/{name}": float(s.active) for name, s in self.states.items()}
        out["health/actionable_active"] = float(
            sum(s.active for n, s in self.states.items() if n in ACTIONABLE_ALARMS)
        )
        out["health/rollbacks"] = float(self.rollbacks)
        return out

    def measured_bad(self, alarm: str, step: int, threshold: float) -> bool:
        """Whether the value of ``alarm``'s metric at ``step`` was past ``threshold``
        (False when the alarm judges several values together or none was measured)."""
        det = next(d for d in DETECTORS if d.name == alarm)
        if det.bad is None:
            return False
        value = dict(self.history.get(det.metric)).get(step)
        return value is not None and det.bad(value, threshold)

    def active(self) -> dict[str, int]:
        """Active alarms and the step each started at."""
        return {n: s.start_step for n, s in self.states.items() if s.active}

    # ------------------------------------------------------------------ actions
    def rolled_back(
        self, alarm_step: int, to_step: int, checkpoint: str, lr_factor: float, lr: Any
    ) -> None:
        """The trainer restored the checkpoint of ``to_step``: forget later values, clear
        every active alarm (reason ``rollback``), record the rollback."""
        self.rollbacks += 1
        self.history.truncate_after(to_step)
        events = []
        for det in DETECTORS:
            s = self.states[det.name]
            if s.active:
                e = self._base_event("clear", det.name, alarm_step, det.metric)
                e["reason"] = f"rollback to step {to_step}"
                events.append(e)
            self.states[det.name] = _AlarmState()
        events.append(
            {
                "event": "rollback",
                "step": alarm_step,
                "to_step": to_step,
                "checkpoint": checkpoint,
                "lr_factor": lr_factor,
                "lr": lr,
                "rollbacks": self.rollbacks,
                "time": time.time(),
            }
        )
        self._emit(events)

    def stopped(self, step: int, trigger: dict[str, Any], message: str) -> None:
        self._emit(
            [
                {
                    "event": "stop",
                    "step": step,
                    "alarm": trigger.get("alarm"),
                    "message": message,
                    "time": time.time(),
                }
            ]
        )

    # ------------------------------------------------------------------ resume
    def replay(self, rows: list[dict[str, Any]], last_step: int) -> None:
        """After a resume at ``last_step + 1``: rebuild the histories and alarm states from
        ``stats.jsonl`` rows (quietly) and drop the events of later steps from
        ``health.jsonl`` (they are redone)."""
        for row in sorted(rows, key=lambda r: r.get("global_step", -1)):
            step = int(row.get("global_step", -1))
            if step > last_step:
                continue
            self.add_eval(step, row)
            if step >= 0:
                self.observe(step, row, quiet=True)
        self.rollbacks = int(max((r.get("health/rollbacks", 0) for r in rows), default=0))
        if self.path and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [
                    ln for ln in f if ln.strip() and json.loads(ln).get("step", -1) <= last_step
                ]
            with open(self.path, "w") as f:
                f.writelines(kept)

    # ------------------------------------------------------------------ events
    def _base_event(self, event: str, alarm: str, step: int, metric: str) -> dict[str, Any]:
        kind = "actionable" if alarm in ACTIONABLE_ALARMS else "informational"
        return {
            "event": event,
            "alarm": alarm,
            "kind": kind,
            "step": int(step),
            "metric": metric,
            "action": self.config.action_for(alarm) if kind == "actionable" else "log",
            "time": time.time(),
        }

    def _event(self, event: str, det: Any, step: int, f: Finding) -> dict[str, Any]:
        e = self._base_event(event, det.name, step, det.metric)
        e.update(
            value=f.value,
            threshold=f.threshold,
            recent=[[s, v] for s, v in f.recent],
            detail=f.detail,
            suggestion=det.suggestion,
        )
        if event == "clear":
            start = self.states[det.name].start_step
            e["started_at"] = start
        return e

    def _emit(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        self.events.extend(events)
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as f:
                for e in events:
                    f.write(json.dumps(e) + "\n")
        for e in events:
            logger_fn = logger.info
            if e["event"] == "start" and (
                e.get("kind") == "actionable" or e.get("alarm") in WARNING_ALARMS
            ):
                logger_fn = logger.warning
            logger_fn(format_event(e))


def format_event(e: dict[str, Any]) -> str:
    """One log line for a ``health.jsonl`` event."""
    kind = e["event"]
    if kind == "rollback":
        return (
            f"run health: rolled back at step {e['step']} to the recover checkpoint of step "
            f"{e['to_step']} ({e['checkpoint']}); learning rate x{e['lr_factor']} -> {e['lr']}"
        )
    if kind == "stop":
        return f"run health: {e['message']}"
    if kind == "clear":
        why = e.get("reason") or e.get("detail", "")
        return f"run health: {e['alarm']} cleared at step {e['step']} ({why})"
    recent = ", ".join(f"{s}: {v:.4g}" for s, v in e.get("recent", []))
    return (
        f"run health: {e['kind']} alarm {e['alarm']} started at step {e['step']}: "
        f"{e['detail']} [recent {recent}]; suggested: {e['suggestion']}"
        + (f"; action: {e['action']}" if e["kind"] == "actionable" else "")
    )


__all__ = ["ALARMS", "HEALTH_FILE", "HealthReport", "RunHealthMonitor", "batch_signals"]
