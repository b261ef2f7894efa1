"""Result collection of ``WorkflowExecutor``: taking accepted rollouts out.

- ``wait(count)``: drop results older than the staleness bound (re-queued), take
  ``count`` accepted results oldest submit version first (``dynamic``: once accepted +
  rejected reach ``count``);
- ``rollout_batch(data)``: submit all, wait until none is queued or running, take theirs;
- ``prepare_batch(dataloader)``: top the queue up from the dataloader and wait for one
  batch, warning when no batch came for a minute;
- every wait ends the same way (``_hand_out``): record the consumption (staleness
  statistics in ``stats_tracker``, ``last_submit_versions``) and return one padded batch
  (``concat_padded_tensors``) or the list of results;
- a wait that has not returned after 5 s logs, every 10 s (``areal.infra.wait_log``), what
  it waits for (``_describe_wait_locked``);
- every slice of every wait (0.1 s) first checks (``_check_alive_locked``) that the loop
  is alive, that episodes are not failing past the limits (``RolloutFailureError``, from
  ``failure_monitor``) and that no stop was requested (``interrupt_waits_on``: the event is
  set, e.g. by the trainer's SIGTERM handler: ``WaitInterrupted``, results stay queued).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from areal.infra.rollout.rollout_submission import cycle_dataloader
from areal.infra.wait_log import WaitLog
from areal.utils import stats_tracker
from areal.utils.batch import concat_padded_tensors

if TYPE_CHECKING:
    from areal.api.workflow_api import RolloutWorkflow

__all__ = ["ResultCollectionMixin", "RolloutResult", "WaitInterrupted", "is_tensor_dict"]

# Slice used by blocking waits so that thread death / staleness are noticed.
_WAIT_SLICE_S = 0.1
# prepare_batch warns (with the rejection reasons) when no batch was produced for this long.
_NO_PROGRESS_WARN_S = 60.0
# wait() warns this often when queued rollouts can never start at the current version.
_STALL_WARN_S = 30.0


class WaitInterrupted(Exception):
    """A wait ended early because the event given to ``interrupt_waits_on`` was set."""


@dataclass
class RolloutResult:
    """One accepted rollout waiting to be consumed."""

    task_id: int
    trajectory: Any
    submit_version: int
    accept_version: int
    is_eval: bool
    seq: int  # acceptance order
    data: Any = None


def is_tensor_dict(x: Any) -> bool:
    """A dict with at least one tensor value (a trajectory batch)."""
    return isinstance(x, dict) and any(isinstance(v, torch.Tensor) for v in x.values())


class ResultCollectionMixin:
    """The waits of ``WorkflowExecutor`` (module docstring).

    Uses the executor's ``_cv`` (the condition guarding its queues), ``_results``,
    ``_pending``, ``_inflight``, ``_rejected_since_export``, ``_dynamic_rejected``,
    ``_eval_running``, ``_shutdown``, ``_interrupt``, ``failures``, ``eval_failures``,
    ``staleness_manager``, ``consumer_batch_size``,
    ``max_staleness``, ``inference_engine``, the submission side (``submit``,
    ``_top_up``, ``_drop_stale_locked``, ``_resolve_workflow``: ``rollout_submission``)
    and ``_get_version``/``_raise_if_dead``/``_require_initialized``.
    """

    def interrupt_waits_on(self, event: threading.Event | None) -> None:
        """While ``event`` is set, every wait raises ``WaitInterrupted`` within a slice
        (0.1 s); results stay queued. ``None``: waits are not interruptible."""
        self._interrupt = event

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> dict[str, Any] | list[Any] | None:
        """Take ``count`` accepted results, oldest submit version first.

        Returns a padded batch (``concat_padded_tensors``) when all results are tensor
        dicts, otherwise the list of results. On timeout raises ``TimeoutError`` (or
        returns ``None`` with ``raise_timeout=False``; results stay queued).
        """
        return self._wait(count, timeout, raise_timeout, dynamic=False)

    def _wait(
        self,
        count: int,
        timeout: float | None,
        raise_timeout: bool,
        dynamic: bool,
        bounded: bool = False,
    ) -> dict[str, Any] | list[Any] | None:
        """``wait``; with ``dynamic``, return once accepted + rejected reach ``count``
        (at least one accepted), taking the accepted ones and consuming the rejections.
        ``bounded`` (a step's batch, ``prepare_batch``): once the step's groups reach
        ``rollout.max_num_gen_batches`` batches, the accepted ones plus filtered groups
        (``_take_at_bound_locked``); the step's figures go to the stats."""
        self._require_initialized()
        if count < 0:
            raise ValueError(f"count={count}; must be >= 0")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        start = last_warn = time.monotonic()
        wait_log = WaitLog(self.logger, level="info")
        with self._cv:
            while True:
                self._check_alive_locked()
                version = self._get_version()
                self._drop_stale_locked(version)
                n_take = count
                if dynamic and count > 0:
                    n_ready, n_rej = len(self._results), self._dynamic_rejected
                    if n_ready >= 1 and n_ready + n_rej >= count:
                        # count attempts: rejections first, the rest from the accepted
                        # (extra accepted results stay for the next batch)
                        n_take = min(n_ready, max(1, count - n_rej))
                        self._dynamic_rejected -= min(n_rej, count - n_take)
                if len(self._results) >= n_take:
                    # Oldest first; submission order (task id) breaks ties so that a
                    # synchronous run consumes the same rows in the same order every time.
                    self._results.sort(key=lambda r: (r.submit_version, r.task_id))
                    taken, self._results = self._results[:n_take], self._results[n_take:]
                    break
                if bounded and n_take > 0:
                    at_bound = self._take_at_bound_locked(n_take, version)
                    if at_bound is not None:
                        taken = at_bound
                        break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if not raise_timeout:
                        return None
                    stat = self.staleness_manager.get_stats()
                    raise TimeoutError(
                        f"WorkflowExecutor.wait: timed out after {time.monotonic() - start:.1f} s "
                        f"waiting for {count} accepted rollouts: {len(self._results)} arrived, "
                        f"{stat.running + self._eval_running} running, {len(self._pending)} queued "
                        f"({stat.rejected} rejected so far; paused={self.is_paused}; "
                        f"version={version})"
                    )
                if time.monotonic() - last_warn >= _STALL_WARN_S:
                    last_warn = time.monotonic()
                    self._warn_if_blocked_locked(count, version)
                wait_log.tick(lambda v=version: self._describe_wait_locked(count, v))
                self._wait_slice_locked(remaining)
            rejected = self._take_rejected_locked()
            step = self.gen_bound.end_step() if bounded else None
        if step is not None:
            _record_step(step)
        return self._hand_out(taken, version, rejected)

    def _take_at_bound_locked(self, count: int, version: int) -> list[RolloutResult] | None:
        """Once the step's finished groups reached ``rollout.max_num_gen_batches`` x
        ``consumer_batch_size`` with fewer than ``count`` accepted: all the accepted ones
        plus filtered groups of the reserve (newest first, within the staleness bound) up
        to ``count``, and the WARNING naming the cause. None below the bound, or when there
        is nothing at all to hand out (the wait goes on; the warning is logged once)."""
        gb = self.gen_bound
        if not gb.reached(self.consumer_batch_size):
            return None
        filler = gb.take_filler(count - len(self._results), version, self.max_staleness)
        accepted = len(self._results)
        message = gb.bound_message(self.consumer_batch_size, accepted, len(filler))
        if message is not None:
            self.logger.warning(message)
        if not accepted and not filler:
            return None
        self._results.sort(key=lambda r: (r.submit_version, r.task_id))
        taken, self._results = self._results + filler, []
        # the filtered groups trained on count towards the staleness bound as accepted ones
        self.staleness_manager.on_rejected_reclaimed(len(filler))
        self._dynamic_rejected = 0
        return taken

    def fill_at_gen_bound(self, missing: int, batch_size: int) -> dict[str, Any] | None:
        """The synchronous trainer's bound (``async_training=false``, its batch drawn by
        ``rollout_batch`` calls): once this step's finished groups reached
        ``rollout.max_num_gen_batches`` x ``batch_size``, up to ``missing`` filtered groups
        to fill its batch (padded batch), with the WARNING; None below the bound or when
        none was kept. Call ``end_step`` when the step's batch is complete."""
        self._require_initialized()
        gb = self.gen_bound
        with self._cv:
            if missing <= 0 or not gb.reached(batch_size):
                return None
            filler = gb.take_filler(missing, self._get_version(), self.max_staleness)
            message = gb.bound_message(batch_size, batch_size - missing, len(filler))
            self.staleness_manager.on_rejected_reclaimed(len(filler))
        if message is not None:
            self.logger.warning(message)
        if not filler:
            return None
        trajs = [r.trajectory for r in filler]
        if all(is_tensor_dict(t) for t in trajs):
            return concat_padded_tensors(trajs)
        return None

    def end_step(self) -> None:
        """The synchronous trainer's step is complete: its figures go to the stats
        (``rollout/gen_bound_hit``, ...) and the next step's tally starts."""
        with self._cv:
            step = self.gen_bound.end_step()
        _record_step(step)

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        timeout: float | None = None,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> dict[str, Any] | list[Any]:
        """Submit every item of ``data``, wait until all finished, return the accepted ones.

        As AReaL: rejected items (``None``, errors, filtered out) are not replaced, so the
        result may hold fewer than ``len(data)`` results (``{}`` when none was accepted).
        ``last_submit_versions`` then has one entry per accepted result.
        """
        wf = self._resolve_workflow(
            workflow, workflow_kwargs, group_size, reward_normalization, drop_incomplete_group
        )
        tids = {self.submit(item, wf, None, should_accept_fn) for item in data}
        return self._wait_tasks(tids, timeout)

    def _wait_tasks(self, tids: set[int], timeout: float | None) -> dict[str, Any] | list[Any]:
        """Wait until none of ``tids`` is queued or running; take their accepted results."""
        self._require_initialized()
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        wait_log = WaitLog(self.logger, level="info")
        with self._cv:
            while True:
                self._check_alive_locked()
                busy = sum(t.task_id in tids for t in self._pending) + sum(
                    tid in tids for tid in self._inflight
                )
                if busy == 0:
                    break
                wait_log.tick(
                    lambda busy=busy: (
                        f"rollout_batch: {busy} of {len(tids)} rollouts unfinished; "
                        + self._describe_wait_locked(0, self._get_version())
                    )
                )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"WorkflowExecutor.rollout_batch: timed out after {timeout} s with "
                        f"{busy} of {len(tids)} rollouts unfinished (paused={self.is_paused})"
                    )
                self._wait_slice_locked(remaining)
            taken = sorted((r for r in self._results if r.task_id in tids), key=lambda r: r.task_id)
            self._results = [r for r in self._results if r.task_id not in tids]
            rejected = self._take_rejected_locked()
            self._dynamic_rejected = 0
        return self._hand_out(taken, self._get_version(), rejected)

    def prepare_batch(
        self,
        dataloader: Iterable[Any],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        timeout: float | None = None,
        dynamic_bs: bool = False,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> dict[str, Any] | list[Any]:
        """Return ``consumer_batch_size`` accepted results, keeping the pipeline full.

        ``dynamic_bs``: return once accepted + rejected results reach
        ``consumer_batch_size`` (at least one accepted), only the accepted ones.

        Items are drawn from ``dataloader`` (lists of dicts, epoch after epoch) and
        enqueued so that the background loop always has enough work to use all capacity
        that opens up while the trainer trains on this batch. ``timeout`` (seconds, None =
        no limit) bounds this call; without progress a warning is logged every minute.
        """
        self._require_initialized()
        wf = self._resolve_workflow(
            workflow, workflow_kwargs, group_size, reward_normalization, drop_incomplete_group
        )
        accept_fn = self._resolve_accept_fn(should_accept_fn)
        if self._det is not None:  # rollout_deterministic
            self._det.dynamic_bs = bool(dynamic_bs)
            return self._det_prepare_batch(dataloader, wf, accept_fn, timeout)
        if dataloader is not self._dataloader or self._data_iter is None:
            self._dataloader = dataloader
            self._data_iter = cycle_dataloader(dataloader)
        start = last_warn = time.monotonic()
        wait_log = WaitLog(self.logger, level="info")
        while True:
            self._top_up(wf, accept_fn)
            batch = self._wait(
                self.consumer_batch_size,
                _WAIT_SLICE_S * 2,
                raise_timeout=False,
                dynamic=dynamic_bs,
                bounded=True,
            )
            if batch is not None:
                return batch
            now = time.monotonic()
            if timeout is not None and now - start >= timeout:
                # raises with the standard message
                return self.wait(self.consumer_batch_size, timeout=0.0)
            wait_log.tick(lambda: f"prepare_batch: {self._describe_wait(self.consumer_batch_size)}")
            if now - last_warn >= _NO_PROGRESS_WARN_S:
                last_warn = now
                stat = self.staleness_manager.get_stats()
                with self._cv:
                    progress = self.gen_bound.progress()
                self.logger.warning(
                    "prepare_batch: no batch after %.0f s (%d ready, %d running, %d queued, "
                    "%d rejected, rejections %s, paused=%s)%s",
                    now - start,
                    len(self._results),
                    stat.running,
                    stat.enqueued,
                    stat.rejected,
                    self.rejection_reasons,
                    self.is_paused,
                    f"; {progress}" if progress else "",
                )

    def _describe_wait(self, count: int) -> str:
        with self._cv:
            return self._describe_wait_locked(count, self._get_version())

    def _describe_wait_locked(self, count: int, version: int) -> str:
        """What a waiting caller waits for (one line, see the module docstring)."""
        running = sorted(self._inflight)
        ids = ", ".join(map(str, running[:8])) + (", ..." if len(running) > 8 else "")
        engine = self.inference_engine
        servers = ""
        summary = getattr(engine, "inflight_summary", None)
        if callable(summary):
            try:
                servers = f"; servers: {summary()}"
            except Exception as e:  # noqa: BLE001 - a log line must not break the wait
                servers = f"; servers: <{type(e).__name__}: {e}>"
        return (
            f"{count} accepted rollout(s): {len(self._results)} ready, {len(running)} running "
            f"(task ids [{ids}]), {len(self._pending)} queued, paused={self.is_paused}, "
            f"version={version}{servers}"
        )

    def _warn_if_blocked_locked(self, count: int, version: int) -> None:
        stat = self.staleness_manager.get_stats()
        if (
            stat.running == 0
            and self._pending
            and self.staleness_manager.get_capacity(version) <= 0
        ):
            self.logger.warning(
                "wait(%d): %d results ready, nothing running, %d rollouts queued but the "
                "staleness bound allows no more at version %d (accepted=%d, "
                "max_head_offpolicyness=%d, consumer_batch_size=%d): bump the version "
                "(set_version) or wait for fewer",
                count,
                len(self._results),
                len(self._pending),
                version,
                stat.accepted,
                self.max_staleness,
                self.consumer_batch_size,
            )

    def _record_consumption(self, taken: list[RolloutResult], version: int, rejected: int) -> None:
        self.last_submit_versions = [r.submit_version for r in taken]
        self.last_consume_version = version
        train = [r for r in taken if not r.is_eval]
        tracker = stats_tracker.DEFAULT_TRACKER
        with tracker.disable_scope(), tracker.scope("rollout"):
            tracker.scalar(
                n_accepted=len(train), n_rejected=rejected, n_failed=self.failures.take_failed()
            )
            if train:
                lags = [version - r.submit_version for r in train]
                tracker.scalar(
                    staleness_avg=sum(lags) / len(lags),
                    staleness_max=max(lags),
                    submit_version_min=min(r.submit_version for r in train),
                )

    @property
    def filler_total(self) -> int:
        """Filtered groups handed out to fill a batch at the bound, over the executor's life."""
        return self.gen_bound.filler_total

    # ------------------------------------------------------------------ shared by the waits
    def _check_alive_locked(self) -> None:
        """Raise if the background loop died or the executor was destroyed, if episodes
        keep failing (``RolloutFailureError``) or a stop was requested (``WaitInterrupted``)."""
        self._raise_if_dead()
        if self._shutdown.is_set():
            raise RuntimeError("WorkflowExecutor was destroyed while waiting")
        self.failures.raise_if_tripped()
        self.eval_failures.raise_if_tripped()
        if self._interrupt is not None and self._interrupt.is_set():
            raise WaitInterrupted("a stop was requested while waiting for rollouts")

    def _wait_slice_locked(self, remaining: float | None) -> None:
        """Block on the condition for one slice (at most ``remaining`` seconds)."""
        self._cv.wait(_WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S))

    def _take_rejected_locked(self) -> int:
        """Rejections since the last batch was handed out (reset to 0)."""
        rejected = self._rejected_since_export
        self._rejected_since_export = 0
        return rejected

    def _hand_out(
        self, taken: list[RolloutResult], version: int, rejected: int
    ) -> dict[str, Any] | list[Any]:
        """The tail of every wait: record the consumption, return the trajectories as one
        padded batch when all are tensor dicts (``{}`` when none), else as a list."""
        self._record_consumption(taken, version, rejected)
        trajs = [r.trajectory for r in taken]
        if not trajs:
            return {}
        if all(is_tensor_dict(t) for t in trajs):
            return concat_padded_tensors(trajs)
        return trajs


def _record_step(step: dict[str, float]) -> None:
    """One step's generation figures (``GenerationBound.end_step``) as ``rollout/*`` stats."""
    tracker = stats_tracker.DEFAULT_TRACKER
    with tracker.disable_scope(), tracker.scope("rollout"):
        tracker.scalar(**step)
