"""Submission and staleness of ``WorkflowExecutor``: what gets queued, what is too old.

- ``submit``: resolve the workflow (an instance, a class or an import string, cached by
  class and kwargs; wrapped in ``GroupedRolloutWorkflow`` for ``group_size > 1``) and the
  accept function, then enqueue one ``RolloutTask`` (bounded by ``queue_size``) and tell
  the ``StalenessManager``;
- ``_top_up`` (``prepare_batch``): enqueue rows re-queued for replay first, then
  dataloader rows (``cycle_dataloader``, epoch after epoch), until queued work covers the
  capacity plus one batch;
- ``_drop_stale_locked``: accepted results whose submit version is more than
  ``max_head_offpolicyness`` behind are dropped (``reason="stale"``) and their rows
  re-queued; ``_reject_locked`` counts every rejection by reason;
- ``pending_data`` / ``requeue_data``: the rows not yet consumed (for a recover
  checkpoint) and the rows to run first after a resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal.infra.rollout.grouped_workflow import GroupedRolloutWorkflow
from areal.utils.dynamic_import import import_from_string

if TYPE_CHECKING:
    from areal.api.workflow_api import RolloutWorkflow

__all__ = ["RolloutTask", "SubmissionMixin", "cycle_dataloader", "kwargs_equal"]

# Rejections that count towards a dynamic batch (dynamic_bs): not stale drops/cancellations.
_DYNAMIC_BS_REASONS = frozenset({"none", "filtered", "error", "invalid"})


@dataclass
class RolloutTask:
    """One queued or running rollout."""

    task_id: int
    data: Any
    workflow: Any
    should_accept_fn: Callable[[Any], bool] | None
    is_eval: bool
    enqueue_time: float = field(default_factory=time.monotonic)
    # deterministic runs: the row's place in the draw order and the wave (batch) it is for
    data_index: int | None = None
    wave: int | None = None


class SubmissionMixin:
    """The submission side of ``WorkflowExecutor`` (module docstring).

    Uses the executor's ``_cv``, ``_pending``, ``_inflight``, ``_results``, ``_replay``,
    ``_task_ids``, ``_workflow_cache``, ``_reject_reasons``, ``_rejected_since_export``,
    ``_dynamic_rejected``, ``_data_iter``, ``staleness_manager``, ``queue_size``,
    ``consumer_batch_size``, ``max_staleness``, ``logger`` and
    ``_get_version``/``_wake_loop``/``_raise_if_dead``/``_require_initialized``.
    """

    def _resolve_workflow(
        self,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None,
        group_size: int,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> Any:
        if workflow is None:
            raise ValueError("workflow is required (an instance, a class or an import string)")
        if group_size < 1:
            raise ValueError(f"group_size={group_size}; must be >= 1")
        instance = None
        if isinstance(workflow, str) or isinstance(workflow, type):
            for key, kwargs, inst in self._workflow_cache:
                if key is workflow or (isinstance(key, str) and key == workflow):
                    if kwargs is workflow_kwargs or kwargs_equal(kwargs, workflow_kwargs or {}):
                        instance = inst
                        break
            if instance is None:
                cls = import_from_string(workflow) if isinstance(workflow, str) else workflow
                if not callable(cls):
                    raise TypeError(f"workflow {workflow!r} is not a class or factory")
                instance = cls(**(workflow_kwargs or {}))
                self._workflow_cache.append((workflow, dict(workflow_kwargs or {}), instance))
        else:
            if workflow_kwargs:
                raise ValueError(
                    "workflow_kwargs are only used when workflow is a class or a string"
                )
            instance = workflow
        if not hasattr(instance, "arun_episode"):
            raise TypeError(f"workflow {type(instance).__name__} has no arun_episode()")
        if group_size > 1:
            instance = GroupedRolloutWorkflow(
                instance,
                group_size,
                reward_normalization=reward_normalization,
                drop_incomplete_group=drop_incomplete_group,
                serialize=self.config.serialize_group_samples,
            )
        return instance

    @staticmethod
    def _resolve_accept_fn(fn: Any) -> Callable[[Any], bool] | None:
        if fn is None:
            return None
        if isinstance(fn, str):
            fn = import_from_string(fn)
        if not callable(fn):
            raise TypeError(f"should_accept_fn {fn!r} is not callable")
        return fn

    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> int:
        """Enqueue one rollout; returns its task id. It starts when capacity allows.

        ``reward_normalization`` / ``drop_incomplete_group``: AReaL 2.0's group options
        (``gconfig``), see :class:`GroupedRolloutWorkflow` (``group_size > 1`` only)."""
        self._require_initialized()
        self._raise_if_dead()
        wf = self._resolve_workflow(
            workflow, workflow_kwargs, group_size, reward_normalization, drop_incomplete_group
        )
        accept_fn = self._resolve_accept_fn(should_accept_fn)
        with self._cv:
            if self.queue_size is not None and len(self._pending) >= self.queue_size:
                raise RuntimeError(
                    f"rollout input queue is full ({len(self._pending)} >= queue_size="
                    f"{self.queue_size}); wait() for results or raise queue_size"
                )
            tid = next(self._task_ids) if task_id is None else int(task_id)
            self._pending.append(RolloutTask(tid, data, wf, accept_fn, bool(is_eval)))
            if not is_eval:
                self.staleness_manager.on_rollout_enqueued()
        self._wake_loop()
        return tid

    def pending_data(self) -> list[Any]:
        """Training data items drawn from the dataloader but not yet consumed by ``wait``.

        Rows waiting to be re-run (re-queued after a resume or a stale rejection) first,
        then queued, running and accepted-but-unconsumed rollouts, in submission order. A recover
        checkpoint stores them (with the dataloader state) so that a resumed run re-runs
        them instead of losing them.
        """
        with self._cv:
            tasks = [(t.task_id, t.data) for t in self._pending if not t.is_eval]
            tasks += [(t.task_id, t.data) for t in self._inflight.values() if not t.is_eval]
            tasks += [(r.task_id, r.data) for r in self._results if not r.is_eval]
            replay = list(self._replay)
        if self._det is not None:
            replay = self._det_pending_rows() + replay
        return replay + [d for _, d in sorted(tasks, key=lambda x: x[0])]

    def requeue_data(self, items: list[Any]) -> None:
        """Run ``items`` before drawing from the dataloader again (used after a resume)."""
        with self._cv:
            self._replay.extend(items)

    def _top_up(self, workflow: Any, accept_fn: Callable[[Any], bool] | None) -> None:
        """Enqueue dataloader items until queued work covers capacity + one batch."""
        if self.is_paused:
            return
        while True:
            stat = self.staleness_manager.get_stats()
            capacity = self.staleness_manager.get_capacity(self._get_version())
            if stat.enqueued >= max(capacity, 0) + self.consumer_batch_size:
                return
            if self.queue_size is not None and stat.enqueued >= self.queue_size:
                return
            if self._replay:
                n = min(len(self._replay), self.consumer_batch_size)
                items = [self._replay.popleft() for _ in range(n)]
            else:
                items = next(self._data_iter)
            if isinstance(items, dict):
                items = [items]
            for item in items:
                if self.queue_size is not None and len(self._pending) >= self.queue_size:
                    break
                self.submit(item, workflow, should_accept_fn=accept_fn)

    def _reject_locked(self, reason: str, is_eval: bool = False) -> None:
        self._reject_reasons[reason] += 1
        self._rejected_since_export += 1
        if not is_eval and reason in _DYNAMIC_BS_REASONS:
            self._dynamic_rejected += 1

    def _drop_stale_locked(self, version: int) -> None:
        kept = []
        for r in self._results:
            if not r.is_eval and version - r.submit_version > self.max_staleness:
                self.staleness_manager.on_rollout_discarded()
                self._reject_locked("stale")
                self._replay.append(r.data)
                self.logger.info(
                    "Dropped stale rollout %d (submitted at version %d, now %d, max %d); "
                    "its row is re-queued",
                    r.task_id,
                    r.submit_version,
                    version,
                    self.max_staleness,
                )
            else:
                kept.append(r)
        if len(kept) != len(self._results):
            self._results = kept
            self._wake_loop()


def kwargs_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a == b``, False when the comparison itself fails."""
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors, whose == is elementwise
        return False


def cycle_dataloader(dataloader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``dataloader`` epoch after epoch (calls ``set_epoch`` on samplers that have it).

    A stateful dataloader restored from a checkpoint taken after the last batch of an
    epoch was drawn yields nothing on its first pass (that epoch is over): only two empty
    passes in a row mean an empty dataloader."""
    epoch = 0
    empty_passes = 0
    while True:
        sampler = getattr(dataloader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in dataloader:
            empty = False
            yield batch
        empty_passes = empty_passes + 1 if empty else 0
        if empty_passes >= 2:
            raise ValueError("prepare_batch: the dataloader yielded no batch")
        epoch += 1
