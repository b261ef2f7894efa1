"""The trainer's side of run health (``areal.utils.run_health``): the batch signals, the
monitor's verdict on each step, and the actions ``stop`` and ``rollback``.

``PPOTrainer.train`` calls :meth:`TrainerHealth.check` once per step, after the update and
the weight sync and *before* the step's recover checkpoint, so the checkpoint of a step
whose statistics raised an alarm is never written when the action is ``stop`` or
``rollback``.

Rollback, in order: the rollout executor drops every rollout it holds (queued, running,
finished: they came from the weights being undone, ``WorkflowExecutor.discard_all``);
the newest verified recover checkpoint of a step before ``start - 1`` is restored exactly as
a resume restores one (``RecoverHandler.restore``: model and optimizer, dataloader
position, saver / evaluator state, RNG, ``stats.jsonl`` / ``consumed.jsonl`` cut after its
step, the servers get its weights and version, its in-flight rows are re-queued); the
learning rate is multiplied by ``run_health.rollback_lr_factor`` on every actor rank
(also in the optimizer's saved schedule, so later checkpoints keep it); the monitor
forgets the undone steps and clears its alarms; the loop continues at the checkpoint's
next step. The statistics of step ``start`` were measured during the update from the
weights of step ``start - 1``, and a detector averages a few steps (the fast ones two), so
the first bad weights can be older than the alarm; with asynchronous rollout the weights
of step ``k`` are judged on their own samples only up to ``lag =
rollout.max_head_offpolicyness`` steps later. So the checkpoint must be of a step before
``start - 1 - run_health.rollback_margin_steps - lag`` (the recover handler then keeps
that margin + 3 checkpoints instead of 2), and, for the alarms judging one value per step
(``Detector.bad``), not one whose weights measured a value past the alarm's threshold at
steps ``k + 1 .. k + 1 + lag`` (a slow slide that crossed the threshold before the
averaged alarm started). Without one the action becomes
``stop``; after ``max_rollbacks`` rollbacks too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from areal.utils import logging
from areal.utils.recover import checkpoint_step
from areal.utils.run_health import RunHealthMonitor, batch_signals

logger = logging.getLogger("RunHealth")


@dataclass
class HealthVerdict:
    """``continue``, ``stop`` (end the run after this step) or ``rolled_back`` (continue
    at ``next_step``)."""

    kind: str = "continue"
    next_step: int | None = None
    message: str = ""
    event: dict[str, Any] | None = None


class TrainerHealth:
    """Run health of one ``PPOTrainer`` (module docstring)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.config = trainer.config.run_health
        self.monitor = RunHealthMonitor(self.config, trainer.log_dir)
        self._filtered_seen = self._filtered()
        # asynchronous rollout: the weights of step k are judged on their own samples only
        # up to max_head_offpolicyness steps later
        cfg = trainer.config
        self.lag = int(cfg.rollout.max_head_offpolicyness) if cfg.async_training else 0
        self.margin = int(self.config.rollback_margin_steps) + self.lag
        if self.config.enabled and self.config.uses_rollback():
            # enough checkpoints that one older than the alarm's margin is still on disk
            handler = trainer.recover_handler
            handler.keep_last = max(handler.keep_last, self.margin + 3)

    # ------------------------------------------------------------------ signals
    def _filtered(self) -> int:
        """Groups the filter dropped (those trained on after all, to fill a batch at
        rollout.max_num_gen_batches, are in the batch and not counted twice)."""
        executor = getattr(self.trainer.rollout, "workflow_executor", None)
        reasons = getattr(executor, "rejection_reasons", None) or {}
        return int(reasons.get("filtered", 0)) - int(getattr(executor, "filler_total", 0))

    def batch_signals(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The consumed batch's signals (groups the dynamic filter dropped since the last
        batch count as groups without signal)."""
        if not self.config.enabled:
            return {}
        n = self._filtered()
        dropped, self._filtered_seen = max(0, n - self._filtered_seen), n
        return batch_signals(batch, int(self.trainer.config.gconfig.n_samples), dropped)

    def add_eval(self, step: int, eval_stats: dict[str, Any] | None) -> None:
        if eval_stats and self.config.enabled:
            self.monitor.add_eval(step, eval_stats)

    def on_resume(self, last_step: int) -> None:
        """After ``RecoverHandler.load``: the alarm states as they were at ``last_step``."""
        if self.config.enabled:
            self.monitor.replay(self.trainer.stats_logger.history, last_step)

    # ------------------------------------------------------------------ verdict
    def check(self, step: int, stats: dict[str, Any]) -> HealthVerdict:
        """Judge step ``step`` (adds ``health/*`` to ``stats``) and carry out the action."""
        report = self.monitor.observe(step, stats)
        stats.update(report.stats)
        trigger = report.trigger
        if trigger is None or report.action == "warn":
            return HealthVerdict()
        if report.action == "rollback":
            if self.monitor.rollbacks >= self.config.max_rollbacks:
                why = f"run_health.max_rollbacks={self.config.max_rollbacks} rollbacks done already"
                return self._stop(step, trigger, why)
            before = step - 1 - self.margin
            # nor one whose weights measured a bad value (steps k + 1 .. k + 1 + lag
            # measure those of checkpoint k)
            alarm, thr = trigger["alarm"], trigger["threshold"]

            def skip(k: int) -> bool:
                steps = range(k + 1, k + 2 + self.lag)
                return any(self.monitor.measured_bad(alarm, s, thr) for s in steps)

            path = self.trainer.recover_handler.latest_before(before, skip=skip)
            if path is None:
                why = (
                    f"no verified recover checkpoint from before step {before} under "
                    f"{self.trainer.recover_handler.root} to roll back to (recover.freq_steps "
                    "sets how often they are written)"
                )
                return self._stop(step, trigger, why)
            return self._rollback(step, trigger, path)
        return self._stop(step, trigger, "")

    def _stop(self, step: int, trigger: dict[str, Any], why: str) -> HealthVerdict:
        latest = self.trainer.recover_handler.latest()
        msg = (
            f"stopping after step {step}: alarm {trigger['alarm']} ({trigger['detail']})"
            + (f"; rollback impossible: {why}" if why else "")
            + f"; suggested: {trigger['suggestion']}. No recover checkpoint of step {step} "
            + "is written; "
            + (
                f"a rerun resumes from {latest}"
                if latest and self.trainer.recover_handler.resumes
                else f"the newest recover checkpoint is {latest}"
            )
        )
        logger.error("run health: " + msg)
        self.monitor.stopped(step, trigger, msg)
        return HealthVerdict("stop", message=msg, event=trigger)

    def _rollback(self, step: int, trigger: dict[str, Any], path: str) -> HealthVerdict:
        t = self.trainer
        logger.warning(
            "run health: alarm %s at step %d: rolling back to %s", trigger["alarm"], step, path
        )
        t.rollout.pause()
        executor = getattr(t.rollout, "workflow_executor", None)
        if executor is not None:
            executor.discard_all()
        info = t.recover_handler.restore(
            path,
            t.actor,
            t.saver,
            t.evaluator,
            t.stats_logger,
            t.train_dataloader,
            inference_engine=t.rollout,
            weight_sync=t.weight_sync,
            reason="rollback",
        )
        to_step = int(info.last_step_info.global_step)
        assert to_step == checkpoint_step(path)
        factor = float(self.config.rollback_lr_factor)
        lr = t.actor.scale_lr(factor)
        t.eval_history = [e for e in t.eval_history if e["global_step"] <= to_step + 1]
        if hasattr(t, "_sync_it"):  # synchronous rollout: read the restored dataloader
            del t._sync_it
        self._filtered_seen = self._filtered()
        self.monitor.rolled_back(step, to_step, path, factor, lr)
        return HealthVerdict("rolled_back", next_step=to_step + 1, event=trigger)
