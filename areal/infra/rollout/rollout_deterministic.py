"""``WorkflowExecutor`` in a ``deterministic: true`` run (``rollout.deterministic``).

The executor follows a :class:`~areal.infra.rollout.deterministic_schedule.DeterministicSchedule`
instead of the staleness bound:

- ``_det_advance`` (the background loop, after every finished task): while the executor
  is not paused, submit the schedule's next round: rows to retry, then new rows drawn from
  the dataloader in order, each with its *data index* (its place in that order, carried in
  the episode's ``workflow_context`` and used for its sampling seeds);
- training tasks start as concurrency allows (no staleness capacity: the version every
  task runs at is fixed by the schedule), are never dropped as stale, and their results go
  to their wave instead of the shared result list; group ids are the task ids and episode
  ids ``task_id * 2**16 + i``, which the submission order fixes;
- ``prepare_batch`` returns wave ``k`` (batch ``k``) once it is complete, its groups in
  submission order, whatever order they finished in;
- ``wait_for_pinned_waves(v)``: the trainer calls it before pushing version ``v + 1``; it
  returns once every wave pinned to version ``v`` is complete, so no request of such a
  wave meets newer weights.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from areal.infra.rollout.deterministic_schedule import DeterministicSchedule
from areal.infra.rollout.rollout_submission import RolloutTask, cycle_dataloader
from areal.infra.wait_log import WaitLog

__all__ = ["DeterministicMixin", "EPISODE_ID_STRIDE"]

#: episode ids of a deterministic task: ``task_id * EPISODE_ID_STRIDE + i``
EPISODE_ID_STRIDE = 1 << 16
_WAIT_SLICE_S = 0.1


class DeterministicMixin:
    """The deterministic mode of ``WorkflowExecutor`` (module docstring).

    Uses the executor's ``_cv``, ``_pending``, ``_replay``, ``_task_ids``, ``_data_iter``,
    ``_dataloader``, ``staleness_manager``, ``consumer_batch_size``, ``max_staleness``,
    ``failures``, ``logger`` and ``_get_version``/``_wake_loop``/``_check_alive_locked``/
    ``_take_rejected_locked``/``_hand_out``/``_resolve_workflow``/``_resolve_accept_fn``.
    """

    _det: DeterministicSchedule | None = None

    def _det_init(self, dynamic_bs: bool = False) -> None:
        self._det = DeterministicSchedule(
            self.consumer_batch_size, self.max_staleness, dynamic_bs=dynamic_bs
        )
        self._det_rows: deque[Any] = deque()
        self._det_next_index = 0
        self._det_workflow: Any = None
        self._det_accept: Callable[[Any], bool] | None = None

    @property
    def deterministic(self) -> bool:
        return self._det is not None

    def rebase_deterministic(self, version: int) -> None:
        """After a resume at ``version``: batch ``version`` comes next, served (with the
        next eta) by ``version``. A no-op outside deterministic mode."""
        if self._det is not None:
            with self._cv:
                self._det.rebase(version)
            self._wake_loop()

    # ------------------------------------------------------------------ the loop side
    def _det_draw_row(self) -> Any:
        if self._replay:  # rows of a recover checkpoint (requeue_data) come first
            return self._replay.popleft()
        while not self._det_rows:
            items = next(self._data_iter)
            self._det_rows.extend([items] if isinstance(items, dict) else list(items))
        return self._det_rows.popleft()

    def _det_advance(self) -> None:
        """Submit what the schedule allows now (background loop; see module docstring)."""
        if self._det_workflow is None or self.is_paused or self.failures.tripped:
            return
        version = self._get_version()
        with self._cv:
            while (rnd := self._det.next_round(version)) is not None:
                items = list(rnd.retry)
                for _ in range(rnd.n_new):
                    items.append((self._det_next_index, self._det_draw_row()))
                    self._det_next_index += 1
                for data_index, row in items:
                    tid = next(self._task_ids)
                    task = RolloutTask(tid, row, self._det_workflow, self._det_accept, False)
                    task.data_index, task.wave = data_index, rnd.wave
                    self._pending.append(task)
                    self.staleness_manager.on_rollout_enqueued()
                    self._det.on_submitted(rnd.wave, tid)
            self._cv.notify_all()

    def _det_on_finished_locked(self, task: RolloutTask, result: Any, reason: str | None) -> None:
        """File a deterministic task's end with its wave (under ``_cv``)."""
        retry = (task.data_index, task.data) if reason == "no_server" else None
        self._det.on_finished(task.task_id, result if reason is None else None, retry)

    # ------------------------------------------------------------------ the trainer side
    def _det_prepare_batch(
        self,
        dataloader: Iterable[Any],
        workflow: Any,
        should_accept_fn: Any,
        timeout: float | None,
    ) -> dict[str, Any] | list[Any]:
        """``prepare_batch`` of a deterministic run: batch ``k`` = wave ``k``."""
        if dataloader is not self._dataloader or self._data_iter is None:
            if self._data_iter is not None:
                raise ValueError(
                    "deterministic rollout: prepare_batch was given another dataloader; a "
                    "deterministic run draws its rows from one dataloader"
                )
            self._dataloader = dataloader
            self._data_iter = cycle_dataloader(dataloader)
        if self._det_workflow is None:
            self._det_workflow = workflow
            self._det_accept = should_accept_fn
        self._wake_loop()
        k = self._det.next_batch
        self._det_wait(k, timeout, f"prepare_batch: batch {k}")
        with self._cv:
            taken = self._det.take(k)
            rejected = self._take_rejected_locked()
        return self._hand_out(taken, self._get_version(), rejected)

    def wait_for_pinned_waves(self, version: int, timeout: float | None = None) -> None:
        """Return once every wave served by weight ``version`` is complete (call before
        pushing ``version + 1``). A no-op outside deterministic mode."""
        if self._det is None or self._det_workflow is None:
            return
        k = self._det.last_wave_pinned_to(version)
        if self.is_paused and not self._det.is_complete(k) and k >= self._det.next_batch:
            raise RuntimeError(
                f"wait_for_pinned_waves({version}): the executor is paused, so wave {k} "
                "(pinned to that version) can never complete; resume() it first"
            )
        self._wake_loop()
        self._det_wait(k, timeout, f"weights v{version + 1} wait for wave {k}")

    def _det_wait(self, k: int, timeout: float | None, what: str) -> None:
        """Block until wave ``k`` is complete (or was already handed out)."""
        self._require_initialized()
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        wait_log = WaitLog(self.logger, level="info")
        with self._cv:
            while not (self._det.is_complete(k) or k < self._det.next_batch):
                self._check_alive_locked()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"deterministic rollout: {what} not complete after {timeout} s "
                        f"({self._describe_wait_locked(self.consumer_batch_size, self._get_version())})"
                    )
                wait_log.tick(
                    lambda: (
                        f"{what}: "
                        + self._describe_wait_locked(self.consumer_batch_size, self._get_version())
                    )
                )
                self._cv.wait(_WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S))

    def _det_pending_rows(self) -> list[Any]:
        """Rows accepted but not yet handed out, rows waiting for a retry, rows drawn but
        not yet submitted (queued and running ones are the executor's)."""
        with self._cv:
            waves = [self._det.waves[k] for k in sorted(self._det.waves)]
            accepted = [w.accepted[t].data for w in waves for t in sorted(w.accepted)]
            retry = [r for _, r in self._det.pending_rows()]
            return accepted + retry + list(self._det_rows)
