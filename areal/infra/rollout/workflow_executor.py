"""``WorkflowExecutor``: runs rollout workflows on a background asyncio loop.

The executor owns one daemon thread with its own event loop. Users (the trainer, or an
``InferenceEngine`` delegating its rollout methods here) call, from any thread:

* ``submit(data, workflow, ...)`` to enqueue one rollout task;
* ``wait(count)`` to take ``count`` accepted results (concatenated, padded);
* ``rollout_batch(data_list, workflow)``: submit all, wait for all;
* ``prepare_batch(dataloader, workflow)``: keep the pipeline full from a dataloader and
  return ``consumer_batch_size`` accepted results;
* ``pause()`` / ``resume()``: stop / restart starting new rollouts (in-flight ones go on).

Enqueued tasks start only while :class:`StalenessManager` reports capacity at the current
weight version (``inference_engine.get_version()``). Every started task records that
version (its *submit version*). When results are consumed, any whose submit version is
more than ``max_head_offpolicyness`` behind the current version is dropped (counted as
rejected, ``reason="stale"``) and replaced, so a consumed trajectory is never older than
the bound, even when a slow rollout was overtaken by faster ones.

A workflow that raises is logged with its traceback and counted as rejected (one that
raises ``NoHealthyServerError``, no server in rotation for a moment, is counted as
``reason="no_server"`` and its row re-queued, as a stale one's); a workflow
returning ``None`` or a result refused by ``should_accept_fn`` is counted as rejected. The
executor itself keeps running.

Groups: with ``group_size = n`` the workflow is wrapped in
:class:`~areal.infra.rollout.grouped_workflow.GroupedRolloutWorkflow` (run ``n`` times per data item,
results concatenated), and ``should_accept_fn`` sees the whole group: it is AReaL's
``dynamic_filter_fn``. A workflow may return a dict of interactions (values with a
``to_tensor_dict()`` method, e.g. the agent client's ``InteractionWithTokenLogpReward``):
they are concatenated into one padded batch before filtering. Every row of a task's
result gets ``group_ids`` ``[B]`` = the task id (one task is one group) and
``episode_ids`` ``[B]``, unique over the executor's life (the rows of one
``arun_episode`` call share one): an agent episode exported one row per call gives a
group of variable size, which the trainer's splits and group statistics handle by id.

With ``config.dump_to_file`` every finished trajectory is also written as text (AReaL's
layout): ``{fileroot}/logs/{experiment_name}/{trial_name}/{rollout|eval-rollout}/
{newest token version}/{task_id}.jsonl``, one JSON line per row (prompt, completion,
reward, lengths, versions), decoded with ``config.tokenizer_path``, off the event loop.

Waits say what they wait for: a ``wait``/``rollout_batch``/``prepare_batch`` that has not
returned after 5 s logs, every 10 s (``areal.infra.wait_log``), how many results it
needs and has, the ids of the running rollouts, how many are queued, whether the
executor is paused, the version, and the inference engine's requests in flight per server
(``inflight_summary()``) with the servers out of rotation.

``prepare_batch(..., dynamic_bs=True)`` (AReaL's ``dynamic_bs``) returns as soon as
accepted + rejected results reach the batch size, with only the accepted ones: a batch of
variable size (at least one result), instead of replacing every rejected result.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal.api.inference_protocol import NoHealthyServerError
from areal.infra.rollout import workflow_context
from areal.infra.rollout.grouped_workflow import (
    GroupedRolloutWorkflow,
    interactions_to_tensor_dict,
    is_interaction_dict,
    tag_group_rows,
)
from areal.infra.rollout.staleness_manager import RolloutStat, StalenessManager
from areal.infra.wait_log import WaitLog
from areal.utils import logging
from areal.utils.batch import concat_padded_tensors
from areal.utils.dynamic_import import import_from_string

if TYPE_CHECKING:
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.workflow_api import RolloutWorkflow

__all__ = ["WorkflowExecutor", "check_trajectory_format"]

# How often the loop re-reads the weight version while tasks wait for capacity.
_VERSION_POLL_S = 0.02
# Slice used by blocking waits so that thread death / staleness are noticed.
_WAIT_SLICE_S = 0.1
_SHUTDOWN_TIMEOUT_S = 10.0
# prepare_batch warns (with the rejection reasons) when no batch was produced for this long.
_NO_PROGRESS_WARN_S = 60.0
# wait() warns this often when queued rollouts can never start at the current version.
_STALL_WARN_S = 30.0
# Rejections that count towards a dynamic batch (dynamic_bs): not stale drops/cancellations.
_DYNAMIC_BS_REASONS = frozenset({"none", "filtered", "error", "invalid"})


def check_trajectory_format(data: Any) -> None:
    """Raise ``ValueError`` unless ``data`` is a padded tensor dict with a batch dim."""
    import torch

    if not isinstance(data, dict) or not data:
        raise ValueError(f"trajectory must be a non-empty dict, got {type(data).__name__}")
    for key in ("input_ids", "attention_mask"):
        if key not in data:
            raise ValueError(f"trajectory misses required key {key!r}; has {sorted(data)}")
    ids = data["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise ValueError("trajectory input_ids must be a 2-D tensor [batch, seqlen]")
    bs, seqlen = ids.shape
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.shape[0] != bs:
                raise ValueError(
                    f"trajectory tensor {key!r} has shape {tuple(value.shape)}; "
                    f"expected leading batch dim {bs}"
                )
            if value.ndim >= 2 and value.shape[1] != seqlen:
                raise ValueError(
                    f"trajectory tensor {key!r} has shape {tuple(value.shape)}; "
                    f"expected seqlen {seqlen} like input_ids"
                )


@dataclass
class _Task:
    task_id: int
    data: Any
    workflow: Any
    should_accept_fn: Callable[[Any], bool] | None
    is_eval: bool
    enqueue_time: float = field(default_factory=time.monotonic)


@dataclass
class _Result:
    task_id: int
    trajectory: Any
    submit_version: int
    accept_version: int
    is_eval: bool
    seq: int  # acceptance order
    data: Any = None


class WorkflowExecutor:
    """Background rollout runner with staleness control (see module docstring)."""

    def __init__(self, config: InferenceEngineConfig, inference_engine: Any):
        self.config = config
        self.inference_engine = inference_engine
        self.logger = logging.getLogger("WorkflowExecutor")
        self.consumer_batch_size = max(1, int(getattr(config, "consumer_batch_size", 1)))
        mcr = getattr(config, "max_concurrent_rollouts", None)
        self.max_concurrent_rollouts = int(mcr) if mcr else self.consumer_batch_size
        self.max_staleness = int(getattr(config, "max_head_offpolicyness", 0))
        qs = getattr(config, "queue_size", None)
        self.queue_size: int | None = int(qs) if qs else None
        self._check_format = bool(getattr(config, "check_trajectory_format", False))
        self._tracing = bool(getattr(config, "enable_rollout_tracing", False))
        self._dump_to_file = bool(getattr(config, "dump_to_file", False))
        self._dump_tokenizer: Any = None
        self._dump_lock = threading.Lock()
        self._dump_warned = False

        self.staleness_manager: StalenessManager | None = None
        self._cv = threading.Condition()
        self._pending: deque[_Task] = deque()
        self._results: list[_Result] = []
        self._inflight: dict[int, _Task] = {}
        # Data items to run before drawing from the dataloader again (after a resume).
        self._replay: deque[Any] = deque()
        self._task_ids = itertools.count()
        self._accept_seq = itertools.count()
        self._next_episode_id = 0  # batch-unique episode ids (tag_group_rows)
        self._reject_reasons: Counter[str] = Counter()
        self._rejected_since_export = 0
        # Training rejections not yet counted by a dynamic_bs batch.
        self._dynamic_rejected = 0
        self._eval_running = 0
        self._paused = threading.Event()
        self._shutdown = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread_error: BaseException | None = None
        self._running_tasks: dict[int, asyncio.Task] = {}
        self._workflow_cache: list[tuple[Any, Any, Any]] = []
        self._version_warned = False
        # prepare_batch state
        self._dataloader: Any = None
        self._data_iter: Iterator[Any] | None = None
        #: submit versions of the trajectories returned by the latest ``wait``
        self.last_submit_versions: list[int] = []
        #: version at which the latest ``wait`` returned
        self.last_consume_version: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, logger: Any = None, train_data_parallel_size: int | None = None) -> None:
        """Start the background loop.

        With ``train_data_parallel_size = n`` (one executor per data-parallel rank),
        concurrency and batch size are divided by ``n``.
        """
        if self._thread is not None:
            return
        if logger is not None:
            self.logger = logger
        dp = int(train_data_parallel_size) if train_data_parallel_size else 1
        if dp < 1:
            raise ValueError(f"train_data_parallel_size={train_data_parallel_size}; must be >= 1")
        self.max_concurrent_rollouts = max(1, self.max_concurrent_rollouts // dp)
        self.consumer_batch_size = max(1, self.consumer_batch_size // dp)
        self.staleness_manager = StalenessManager(
            max_concurrent_rollouts=self.max_concurrent_rollouts,
            consumer_batch_size=self.consumer_batch_size,
            max_staleness=self.max_staleness,
            version_provider=self._get_version,
        )
        self._shutdown.clear()
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="WorkflowExecutorLoop", daemon=True
        )
        self._thread.start()
        if not started.wait(timeout=_SHUTDOWN_TIMEOUT_S):
            raise RuntimeError("WorkflowExecutor: background event loop did not start")

    def destroy(self) -> None:
        """Stop the loop, cancel running rollouts, drop queued ones."""
        if self._thread is None:
            return
        self._shutdown.set()
        self._wake_loop()
        with self._cv:
            self._cv.notify_all()
        self._thread.join(timeout=_SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            self.logger.warning(
                "WorkflowExecutor loop did not stop within %.0f s", _SHUTDOWN_TIMEOUT_S
            )
        self._thread = None
        with self._cv:
            for _ in self._pending:
                if self.staleness_manager is not None:
                    self.staleness_manager.on_rollout_dequeued()
            self._pending.clear()

    def __enter__(self) -> WorkflowExecutor:
        self.initialize()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    # ------------------------------------------------------------------ versions
    def _get_version(self) -> int:
        try:
            return int(self.inference_engine.get_version())
        except NotImplementedError:
            if not self._version_warned:
                self._version_warned = True
                self.logger.warning(
                    "inference engine has no get_version(); staleness control assumes version 0"
                )
            return 0

    def on_version_recovered(self, version: int) -> None:
        """Tell the staleness bound that the run resumed at ``version`` (see StalenessManager)."""
        self._require_initialized()
        self.staleness_manager.on_version_recovered(version)
        self._wake_loop()

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        """Stop starting new rollouts; running ones continue."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._wake_loop()

    @property
    def is_paused(self) -> bool:
        return self._paused.is_set()

    def get_stats(self) -> RolloutStat:
        if self.staleness_manager is None:
            return RolloutStat()
        return self.staleness_manager.get_stats()

    @property
    def rejection_reasons(self) -> dict[str, int]:
        """Rejected rollouts by reason: ``error``, ``none``, ``filtered``, ``invalid``, ``stale``."""
        with self._cv:
            return dict(self._reject_reasons)

    def get_capacity(self) -> int:
        self._require_initialized()
        return self.staleness_manager.get_capacity(self._get_version())

    # ------------------------------------------------------------------ workflows
    def _resolve_workflow(
        self, workflow: Any, workflow_kwargs: dict[str, Any] | None, group_size: int
    ) -> Any:
        if workflow is None:
            raise ValueError("workflow is required (an instance, a class or an import string)")
        if group_size < 1:
            raise ValueError(f"group_size={group_size}; must be >= 1")
        instance = None
        if isinstance(workflow, str) or isinstance(workflow, type):
            for key, kwargs, inst in self._workflow_cache:
                if key is workflow or (isinstance(key, str) and key == workflow):
                    if kwargs is workflow_kwargs or _kwargs_equal(kwargs, workflow_kwargs or {}):
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
            instance = GroupedRolloutWorkflow(instance, group_size)
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

    # ------------------------------------------------------------------ submit / wait
    def _require_initialized(self) -> None:
        if self._thread is None or self.staleness_manager is None:
            raise RuntimeError("WorkflowExecutor is not running: call initialize() first")

    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
    ) -> int:
        """Enqueue one rollout; returns its task id. It starts when capacity allows."""
        self._require_initialized()
        self._raise_if_dead()
        wf = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        accept_fn = self._resolve_accept_fn(should_accept_fn)
        with self._cv:
            if self.queue_size is not None and len(self._pending) >= self.queue_size:
                raise RuntimeError(
                    f"rollout input queue is full ({len(self._pending)} >= queue_size="
                    f"{self.queue_size}); wait() for results or raise queue_size"
                )
            tid = next(self._task_ids) if task_id is None else int(task_id)
            self._pending.append(_Task(tid, data, wf, accept_fn, bool(is_eval)))
            if not is_eval:
                self.staleness_manager.on_rollout_enqueued()
        self._wake_loop()
        return tid

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
        self, count: int, timeout: float | None, raise_timeout: bool, dynamic: bool
    ) -> dict[str, Any] | list[Any] | None:
        """``wait``; with ``dynamic``, return once accepted + rejected reach ``count``
        (at least one accepted), taking the accepted ones and consuming the rejections."""
        self._require_initialized()
        if count < 0:
            raise ValueError(f"count={count}; must be >= 0")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        start = last_warn = time.monotonic()
        wait_log = WaitLog(self.logger, level="info")
        with self._cv:
            while True:
                self._raise_if_dead()
                if self._shutdown.is_set():
                    raise RuntimeError("WorkflowExecutor was destroyed while waiting")
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
                self._cv.wait(_WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S))
            rejected = self._rejected_since_export
            self._rejected_since_export = 0
        self._record_consumption(taken, version, rejected)
        trajs = [r.trajectory for r in taken]
        if not trajs:
            return {}
        if all(_is_tensor_dict(t) for t in trajs):
            return concat_padded_tensors(trajs)
        return trajs

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        timeout: float | None = None,
    ) -> dict[str, Any] | list[Any]:
        """Submit every item of ``data``, wait until all finished, return the accepted ones.

        As AReaL: rejected items (``None``, errors, filtered out) are not replaced, so the
        result may hold fewer than ``len(data)`` results (``{}`` when none was accepted).
        ``last_submit_versions`` then has one entry per accepted result.
        """
        wf = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        tids = {self.submit(item, wf, None, should_accept_fn) for item in data}
        return self._wait_tasks(tids, timeout)

    def _wait_tasks(self, tids: set[int], timeout: float | None) -> dict[str, Any] | list[Any]:
        """Wait until none of ``tids`` is queued or running; take their accepted results."""
        self._require_initialized()
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        wait_log = WaitLog(self.logger, level="info")
        with self._cv:
            while True:
                self._raise_if_dead()
                if self._shutdown.is_set():
                    raise RuntimeError("WorkflowExecutor was destroyed while waiting")
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
                self._cv.wait(_WAIT_SLICE_S if remaining is None else min(remaining, _WAIT_SLICE_S))
            taken = sorted((r for r in self._results if r.task_id in tids), key=lambda r: r.task_id)
            self._results = [r for r in self._results if r.task_id not in tids]
            rejected = self._rejected_since_export
            self._rejected_since_export = 0
            self._dynamic_rejected = 0
        self._record_consumption(taken, self._get_version(), rejected)
        trajs = [r.trajectory for r in taken]
        if not trajs:
            return {}
        if all(_is_tensor_dict(t) for t in trajs):
            return concat_padded_tensors(trajs)
        return trajs

    def prepare_batch(
        self,
        dataloader: Iterable[Any],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        timeout: float | None = None,
        dynamic_bs: bool = False,
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
        if dataloader is not self._dataloader or self._data_iter is None:
            self._dataloader = dataloader
            self._data_iter = _cycle(dataloader)
        wf = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        accept_fn = self._resolve_accept_fn(should_accept_fn)
        start = last_warn = time.monotonic()
        wait_log = WaitLog(self.logger, level="info")
        while True:
            self._top_up(wf, accept_fn)
            batch = self._wait(
                self.consumer_batch_size, _WAIT_SLICE_S * 2, raise_timeout=False, dynamic=dynamic_bs
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
                self.logger.warning(
                    "prepare_batch: no batch after %.0f s (%d ready, %d running, %d queued, "
                    "%d rejected, rejections %s, paused=%s)",
                    now - start,
                    len(self._results),
                    stat.running,
                    stat.enqueued,
                    stat.rejected,
                    self.rejection_reasons,
                    self.is_paused,
                )

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

    # ------------------------------------------------------------------ internals (any thread)
    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def _raise_if_dead(self) -> None:
        if self._thread_error is not None:
            raise RuntimeError(
                f"WorkflowExecutor background loop died: {self._thread_error!r}"
            ) from self._thread_error

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

    def _record_consumption(self, taken: list[_Result], version: int, rejected: int) -> None:
        self.last_submit_versions = [r.submit_version for r in taken]
        self.last_consume_version = version
        try:
            from areal.utils import stats_tracker
        except ImportError:  # pragma: no cover - optional
            return
        train = [r for r in taken if not r.is_eval]
        tracker = stats_tracker.DEFAULT_TRACKER
        with tracker.disable_scope(), tracker.scope("rollout"):
            tracker.scalar(n_accepted=len(train), n_rejected=rejected)
            if train:
                lags = [version - r.submit_version for r in train]
                tracker.scalar(
                    staleness_avg=sum(lags) / len(lags),
                    staleness_max=max(lags),
                    submit_version_min=min(r.submit_version for r in train),
                )

    def _load_dump_tokenizer(self, path: str) -> Any:
        with self._dump_lock:  # one import/load even when several dumps start at once
            if self._dump_tokenizer is None:
                from areal.utils.hf_utils import load_hf_tokenizer

                self._dump_tokenizer = load_hf_tokenizer(path)
            return self._dump_tokenizer

    async def _dump_trajectory(self, traj: Any, task: _Task) -> None:
        """``dump_to_file``: write ``traj`` as text (see the module docstring); never raises."""
        import os

        cfg = self.config
        root = getattr(cfg, "fileroot", None)
        exp, trial = getattr(cfg, "experiment_name", None), getattr(cfg, "trial_name", None)
        tok_path = getattr(cfg, "tokenizer_path", None)
        if not (root and exp and trial and tok_path) or not _is_tensor_dict(traj):
            if not self._dump_warned:
                self._dump_warned = True
                self.logger.warning(
                    "dump_to_file: needs rollout.fileroot, experiment_name, trial_name, "
                    "tokenizer_path and tensor trajectories; not dumping"
                )
            return
        try:
            if self._dump_tokenizer is None:
                self._dump_tokenizer = await asyncio.to_thread(self._load_dump_tokenizer, tok_path)
            versions = traj.get("versions")
            gen = traj["loss_mask"].bool()
            tail = int(versions[gen].max()) if versions is not None and bool(gen.any()) else 0
            sub = "eval-rollout" if task.is_eval else "rollout"
            path = os.path.join(root, "logs", exp, trial, sub, str(tail), f"{task.task_id}.jsonl")
            await asyncio.to_thread(_write_dump, path, traj, self._dump_tokenizer, task.task_id)
        except Exception as e:  # a dump must never fail a rollout
            self.logger.warning("dump_to_file: could not dump rollout %d: %r", task.task_id, e)

    # ------------------------------------------------------------------ the loop
    def _thread_main(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(started))
        except BaseException as e:  # noqa: BLE001 - recorded and re-raised to waiters
            self._thread_error = e
            self.logger.error("WorkflowExecutor loop crashed:\n%s", traceback.format_exc())
            with self._cv:
                self._cv.notify_all()
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                self._loop = None
                self._wake = None
                loop.close()

    async def _main(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        started.set()
        while not self._shutdown.is_set():
            waiting_for_capacity = self._start_ready_tasks()
            timeout = _VERSION_POLL_S if waiting_for_capacity else None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                pass
            self._wake.clear()
        tasks = list(self._running_tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_ready_tasks(self) -> bool:
        """Start queued tasks while capacity allows; True if some wait for capacity."""
        if self.is_paused:
            with self._cv:
                return bool(self._pending)
        version = self._get_version()
        sm = self.staleness_manager
        while True:
            with self._cv:
                if not self._pending:
                    return False
                task = self._pending[0]
                if task.is_eval:
                    stat = sm.get_stats()
                    ok = stat.running + self._eval_running < self.max_concurrent_rollouts
                else:
                    ok = sm.get_capacity(version) > 0
                if not ok:
                    return True
                self._pending.popleft()
                self._inflight[task.task_id] = task
                if task.is_eval:
                    self._eval_running += 1
                else:
                    sm.on_rollout_submitted()
            if self._tracing:
                self.logger.info(
                    "Start rollout %d at version %d (%s)", task.task_id, version, sm.get_stats()
                )
            atask = asyncio.ensure_future(self._run_one(task, version))
            self._running_tasks[task.task_id] = atask
            atask.add_done_callback(lambda _t, tid=task.task_id: self._on_task_done(tid))

    def _on_task_done(self, task_id: int) -> None:
        self._running_tasks.pop(task_id, None)
        if self._wake is not None:
            self._wake.set()

    async def _run_one(self, task: _Task, submit_version: int) -> None:
        reason: str | None = None
        traj = None
        workflow_context.set(
            workflow_context.WorkflowContext(is_eval=task.is_eval, task_id=task.task_id)
        )
        try:
            traj = await task.workflow.arun_episode(self.inference_engine, task.data)
            if is_interaction_dict(traj):
                traj = interactions_to_tensor_dict(traj)
            if _is_row_batch(traj):
                # one task = one group: its id, and episode ids unique across the executor
                traj = dict(traj)
                self._next_episode_id += tag_group_rows(traj, task.task_id, self._next_episode_id)
        except asyncio.CancelledError:
            reason = "cancelled"
        except Exception as e:
            if isinstance(e, NoHealthyServerError) and not task.is_eval:
                # No server in rotation for a moment (all restarting or being probed): not
                # the row's fault, so it is generated again (below) instead of lost; the
                # pause keeps a retry loop from spinning while servers come back.
                reason = "no_server"
                self.logger.warning(
                    "Rollout %d: %s; its row is re-queued", task.task_id, str(e)[:300]
                )
                await asyncio.sleep(1.0)
            else:
                reason = "error"
                self.logger.error(
                    "Rollout %d: workflow %s raised; counted as rejected:\n%s",
                    task.task_id,
                    type(task.workflow).__name__,
                    traceback.format_exc(),
                )
        if traj is not None and self._dump_to_file:
            await self._dump_trajectory(traj, task)
        if reason is None and traj is None:
            reason = "none"
        if reason is None and self._check_format:
            try:
                check_trajectory_format(traj)
            except ValueError as e:
                reason = "invalid"
                self.logger.error("Rollout %d returned a malformed trajectory: %s", task.task_id, e)
        if reason is None and task.should_accept_fn is not None:
            try:
                if not task.should_accept_fn(traj):
                    reason = "filtered"
            except Exception:
                reason = "error"
                self.logger.error(
                    "Rollout %d: should_accept_fn raised; counted as rejected:\n%s",
                    task.task_id,
                    traceback.format_exc(),
                )
        version = self._get_version()
        if reason is None and not task.is_eval and version - submit_version > self.max_staleness:
            reason = "stale"
        sm = self.staleness_manager
        with self._cv:
            self._inflight.pop(task.task_id, None)
            if task.is_eval:
                self._eval_running -= 1
            elif reason is None:
                sm.on_rollout_accepted()
            else:
                sm.on_rollout_rejected()
            if reason is None:
                self._results.append(
                    _Result(
                        task_id=task.task_id,
                        trajectory=traj,
                        submit_version=submit_version,
                        accept_version=version,
                        is_eval=task.is_eval,
                        seq=next(self._accept_seq),
                        data=task.data,
                    )
                )
            else:
                self._reject_locked(reason, task.is_eval)
                if reason == "no_server":
                    self._replay.append(task.data)
                elif reason == "stale" and not task.is_eval:
                    # Too old to train on, through no fault of the row (e.g. retries after a
                    # dropped connection): generate it again instead of losing it.
                    self._replay.append(task.data)
                    self.logger.info(
                        "Rollout %d finished stale (submitted at version %d, now %d, max %d); "
                        "its row is re-queued",
                        task.task_id,
                        submit_version,
                        version,
                        self.max_staleness,
                    )
            self._cv.notify_all()
        if self._tracing:
            self.logger.info(
                "Finish rollout %d: %s (%s)", task.task_id, reason or "accepted", sm.get_stats()
            )


def _dump_records(traj: dict[str, Any], tokenizer: Any, task_id: int) -> list[dict[str, Any]]:
    """One text record per row of a padded trajectory (rows without completion skipped)."""
    ids, attn = traj["input_ids"], traj["attention_mask"].bool()
    loss = traj["loss_mask"].bool()
    rewards = traj["rewards"].float().reshape(-1).tolist()
    out = []
    for i in range(ids.shape[0]):
        row = ids[i][attn[i]].tolist()
        gen = loss[i][attn[i]]
        n_gen = int(gen.sum())
        if n_gen == 0:
            continue
        prompt_len = len(row) - n_gen
        out.append(
            dict(
                task_id=task_id,
                sample_idx=i,
                seqlen=len(row),
                prompt_len=prompt_len,
                reward=rewards[i],
                prompt=tokenizer.decode(row[:prompt_len], skip_special_tokens=False),
                completion=tokenizer.decode(row[prompt_len:], skip_special_tokens=False),
            )
        )
    return out


def _write_dump(path: str, traj: dict[str, Any], tokenizer: Any, task_id: int) -> None:
    import json
    import os

    records = _dump_records(traj, tokenizer, task_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _kwargs_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors, whose == is elementwise
        return False


def _is_row_batch(x: Any) -> bool:
    """A dict with a 2-D ``input_ids`` or ``attention_mask`` tensor (rows to tag)."""
    import torch

    return isinstance(x, dict) and any(
        isinstance(x.get(k), torch.Tensor) and x[k].ndim == 2
        for k in ("input_ids", "attention_mask")
    )


def _is_tensor_dict(x: Any) -> bool:
    import torch

    return isinstance(x, dict) and any(isinstance(v, torch.Tensor) for v in x.values())


def _cycle(dataloader: Iterable[Any]) -> Iterator[Any]:
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
