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
executor itself keeps running, but not forever: raised exceptions, malformed trajectories
and a raising ``should_accept_fn`` are *failures*, recorded (with every other finished
episode) by an ``EpisodeFailureMonitor`` (``failure_monitor``; one for training, one for
evaluation episodes); once all of the last ``max_consecutive_episode_failures`` episodes
failed, or more than ``max_episode_failure_ratio`` of the last
``episode_failure_window``, the loop starts no more rollouts and every wait raises
``RolloutFailureError`` quoting the most common failure; so do they once the last
``max_consecutive_rejections`` finished episodes were all rejected as ``filtered`` or
``none`` (a dynamic-sampling filter dropping every group would otherwise keep the batch
from ever filling). Failures since the last batch are the ``rollout/n_failed`` stat.

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

Replacing filtered groups is bounded per step (``rollout.max_num_gen_batches``,
``generation_bound``): once the groups finished since the last batch reach that many
batches, ``prepare_batch`` returns the accepted ones plus the newest filtered groups to
fill the batch, with a WARNING naming the share of all-equal groups (all zero / all max)
and of truncated samples and what to change (``rollout/gen_bound_hit``); an earlier
WARNING already when at most a quarter of a step's first batch of groups was accepted.

Where the parts live: submission and staleness (``submit``, topping up from a
dataloader, stale drops, pending rows) in ``rollout_submission``; result collection
(``wait``, ``rollout_batch``, ``prepare_batch``, the wait log) in ``rollout_results``;
``dump_to_file`` in ``trajectory_dump``; the ``rollout.deterministic`` mode (waves pinned
to weight versions, batches in submission order, no staleness drops) in
``rollout_deterministic``. This module owns the background loop: start
queued tasks while capacity allows, run one episode (workflow context, interactions to
tensors, group/episode ids), then file its result or its rejection.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import traceback
from collections import Counter, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from areal.api.inference_protocol import NoHealthyServerError
from areal.infra.rollout import workflow_context
from areal.infra.rollout.failure_monitor import EpisodeFailureMonitor
from areal.infra.rollout.generation_bound import GenerationBound
from areal.infra.rollout.grouped_workflow import (
    interactions_to_tensor_dict,
    is_interaction_dict,
    tag_group_rows,
)
from areal.infra.rollout.rollout_deterministic import EPISODE_ID_STRIDE, DeterministicMixin
from areal.infra.rollout.rollout_results import ResultCollectionMixin, RolloutResult
from areal.infra.rollout.rollout_submission import RolloutTask, SubmissionMixin
from areal.infra.rollout.staleness_manager import RolloutStat, StalenessManager
from areal.infra.rollout.trajectory_dump import TrajectoryDumper
from areal.utils import logging

if TYPE_CHECKING:
    from areal.api.cli_args import InferenceEngineConfig

__all__ = ["WorkflowExecutor", "check_trajectory_format"]

# How often the loop re-reads the weight version while tasks wait for capacity.
_VERSION_POLL_S = 0.02
_SHUTDOWN_TIMEOUT_S = 10.0


def check_trajectory_format(data: Any) -> None:
    """Raise ``ValueError`` unless ``data`` is a padded tensor dict with a batch dim."""
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


class WorkflowExecutor(SubmissionMixin, ResultCollectionMixin, DeterministicMixin):
    """Background rollout runner with staleness control (see module docstring)."""

    def __init__(self, config: InferenceEngineConfig, inference_engine: Any):
        self.config = config
        self.inference_engine = inference_engine
        self.logger = logging.getLogger("WorkflowExecutor")
        self.consumer_batch_size = max(1, int(config.consumer_batch_size))
        mcr = config.max_concurrent_rollouts
        self.max_concurrent_rollouts = int(mcr) if mcr else self.consumer_batch_size
        self.max_staleness = int(config.max_head_offpolicyness)
        qs = config.queue_size
        self.queue_size: int | None = int(qs) if qs else None
        self._check_format = bool(config.check_trajectory_format)
        self._tracing = bool(config.enable_rollout_tracing)
        self._dumper = TrajectoryDumper(config, self.logger) if config.dump_to_file else None

        self.staleness_manager: StalenessManager | None = None
        self._cv = threading.Condition()
        self._pending: deque[RolloutTask] = deque()
        self._results: list[RolloutResult] = []
        self._inflight: dict[int, RolloutTask] = {}
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
        # failed episodes (exceptions, HTTP errors) vs finished ones, per kind
        self.failures = self._failure_monitor("training", config)
        self.eval_failures = self._failure_monitor("evaluation", config)
        # the step's groups, filtered ones kept to fill a batch (rollout.max_num_gen_batches)
        self.gen_bound = GenerationBound(config.max_num_gen_batches)
        # set (e.g. by a SIGTERM handler) to end a wait at once: WaitInterrupted
        self._interrupt: threading.Event | None = None
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

    @staticmethod
    def _failure_monitor(kind: str, config: InferenceEngineConfig) -> EpisodeFailureMonitor:
        return EpisodeFailureMonitor(
            kind,
            max_consecutive=config.max_consecutive_episode_failures,
            window=config.episode_failure_window,
            max_ratio=config.max_episode_failure_ratio,
            max_consecutive_rejections=config.max_consecutive_rejections,
        )

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
        if self.config.deterministic:
            self._det_init()
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

    def discard_all(self) -> int:
        """Drop every training rollout: queued, running (cancelled), finished but not
        consumed, and the rows waiting to be re-run; restart the loop with fresh staleness
        counters and read the dataloader afresh at the next ``prepare_batch``. Returns how
        many were dropped. For a rollback to a recover checkpoint
        (``areal.trainer.health_rollback``): these rollouts came from weights that no
        longer exist, and the restored checkpoint re-queues the rows it had in flight."""
        with self._cv:
            n = sum(not t.is_eval for t in self._pending) + len(self._inflight)
            n += len(self._results) + len(self._replay)
        mcr, cbs = self.max_concurrent_rollouts, self.consumer_batch_size
        self.destroy()
        with self._cv:
            self._results = []
            self._inflight.clear()
            self._replay.clear()
            self._dynamic_rejected = 0
            self._eval_running = 0
            self.gen_bound.clear()
        self._data_iter = None
        self.initialize()
        self.max_concurrent_rollouts, self.consumer_batch_size = mcr, cbs
        self.staleness_manager.max_concurrent_rollouts = mcr
        self.staleness_manager.consumer_batch_size = cbs
        self.logger.warning("Discarded %d rollouts (rollback)", n)
        return n

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
        self.rebase_deterministic(version)
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

    def _require_initialized(self) -> None:
        if self._thread is None or self.staleness_manager is None:
            raise RuntimeError("WorkflowExecutor is not running: call initialize() first")

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
            if self._det is not None:
                self._det_advance()
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
        if self.failures.tripped or self.eval_failures.tripped:
            return False  # the waits raise RolloutFailureError; nothing new starts
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
                if task.is_eval or task.wave is not None:
                    # evaluation, and deterministic tasks (the schedule fixes their version)
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

    async def _run_one(self, task: RolloutTask, submit_version: int) -> None:
        """One episode: run it (:meth:`_episode`), judge it (:meth:`_judge`: dump,
        format, filter, staleness; the failure monitor), file the result or the
        rejection (:meth:`_file`)."""
        traj, reason, failure = await self._episode(task)
        if traj is not None and self._dumper is not None:
            await self._dumper.dump(traj, task.task_id, task.is_eval)
        reason, version = self._judge(task, traj, reason, failure, submit_version)
        early_warning = self._file(task, traj, reason, submit_version, version)
        if early_warning is not None:
            self.logger.warning(early_warning)
        if self._tracing:
            self.logger.info(
                "Finish rollout %d: %s (%s)",
                task.task_id,
                reason or "accepted",
                self.staleness_manager.get_stats(),
            )

    async def _episode(self, task: RolloutTask) -> tuple[Any, str | None, BaseException | None]:
        """(trajectory, rejection reason, failure) of running the task's workflow once;
        a row batch gets its group id and episode ids here."""
        workflow_context.set(
            workflow_context.WorkflowContext(
                is_eval=task.is_eval, task_id=task.task_id, data_index=task.data_index
            )
        )
        try:
            traj = await task.workflow.arun_episode(self.inference_engine, task.data)
            if is_interaction_dict(traj):
                traj = interactions_to_tensor_dict(traj)
            if _is_row_batch(traj):
                # one task = one group: its id, and episode ids unique across the executor
                traj = dict(traj)
                if task.wave is not None:  # deterministic: ids fixed by the submission order
                    tag_group_rows(traj, task.task_id, task.task_id * EPISODE_ID_STRIDE)
                else:
                    self._next_episode_id += tag_group_rows(
                        traj, task.task_id, self._next_episode_id
                    )
            return traj, None, None
        except asyncio.CancelledError:
            return None, "cancelled", None
        except Exception as e:
            if isinstance(e, NoHealthyServerError) and not task.is_eval:
                # No server in rotation for a moment (all restarting or being probed): not
                # the row's fault, so it is generated again (in _file) instead of lost; the
                # pause keeps a retry loop from spinning while servers come back.
                self.logger.warning(
                    "Rollout %d: %s; its row is re-queued", task.task_id, str(e)[:300]
                )
                await asyncio.sleep(1.0)
                return None, "no_server", None
            self.logger.error(
                "Rollout %d: workflow %s raised; counted as rejected:\n%s",
                task.task_id,
                type(task.workflow).__name__,
                traceback.format_exc(),
            )
            return None, "error", e

    def _judge(
        self,
        task: RolloutTask,
        traj: Any,
        reason: str | None,
        failure: BaseException | None,
        submit_version: int,
    ) -> tuple[str | None, int]:
        """(rejection reason or None, the current version): no trajectory, a malformed
        one, the group filter, staleness; the failure monitor counts the outcome."""
        if reason is None and traj is None:
            reason = "none"
        if reason is None and self._check_format:
            try:
                check_trajectory_format(traj)
            except ValueError as e:
                reason, failure = "invalid", e
                self.logger.error("Rollout %d returned a malformed trajectory: %s", task.task_id, e)
        if reason is None and task.should_accept_fn is not None:
            try:
                if not task.should_accept_fn(traj):
                    reason = "filtered"
            except Exception as e:
                reason, failure = "error", e
                self.logger.error(
                    "Rollout %d: should_accept_fn raised; counted as rejected:\n%s",
                    task.task_id,
                    traceback.format_exc(),
                )
        version = self._get_version()
        stale = version - submit_version > self.max_staleness
        if reason is None and not task.is_eval and task.wave is None and stale:
            reason = "stale"
        monitor = self.eval_failures if task.is_eval else self.failures
        was_tripped = monitor.tripped
        if failure is not None:
            monitor.record_failure(failure)
        elif reason not in ("cancelled", "no_server"):
            monitor.record_ok(rejected=reason)
        if monitor.tripped and not was_tripped:
            self.logger.error(
                "No more rollouts start; the waits raise RolloutFailureError: %s",
                monitor.error,
            )
        return reason, version

    def _file(
        self,
        task: RolloutTask,
        traj: Any,
        reason: str | None,
        submit_version: int,
        version: int,
    ) -> str | None:
        """File the result (accepted) or the rejection under the lock: counters, the
        generation bound, deterministic waves, rows re-queued for no server or
        staleness. Returns the generation bound's early warning, if any."""
        sm = self.staleness_manager
        early_warning = None

        def result_of(is_eval: bool = False) -> RolloutResult:  # numbered when made
            return RolloutResult(
                task_id=task.task_id,
                trajectory=traj,
                submit_version=submit_version,
                accept_version=version,
                is_eval=is_eval,
                seq=next(self._accept_seq),
                data=task.data,
            )

        with self._cv:
            self._inflight.pop(task.task_id, None)
            if not task.is_eval and task.wave is None and reason in (None, "filtered", "none"):
                kept = None  # a filtered group may fill a batch at the step's bound
                if reason == "filtered":
                    kept = result_of()
                early_warning = self.gen_bound.on_finished(
                    traj, reason, kept, self.consumer_batch_size
                )
            if task.is_eval:
                self._eval_running -= 1
            elif reason is None:
                sm.on_rollout_accepted()
            else:
                sm.on_rollout_rejected()
            if task.wave is not None:
                result = None
                if reason is None:
                    result = result_of()
                else:
                    self._reject_locked(reason)
                self._det_on_finished_locked(task, result, reason)
            elif reason is None:
                self._results.append(result_of(task.is_eval))
            else:
                self._reject_locked(reason, task.is_eval)
                self._requeue_locked(task, reason, submit_version, version)
            self._cv.notify_all()
        return early_warning

    def _requeue_locked(
        self, task: RolloutTask, reason: str, submit_version: int, version: int
    ) -> None:
        """A row rejected through no fault of its own is generated again, not lost."""
        if reason == "no_server":
            self._replay.append(task.data)
        elif reason == "stale" and not task.is_eval:
            # Too old to train on (e.g. retries after a dropped connection).
            self._replay.append(task.data)
            self.logger.info(
                "Rollout %d finished stale (submitted at version %d, now %d, max %d); "
                "its row is re-queued",
                task.task_id,
                submit_version,
                version,
                self.max_staleness,
            )


def _is_row_batch(x: Any) -> bool:
    """A dict with a 2-D ``input_ids`` or ``attention_mask`` tensor (rows to tag)."""
    return isinstance(x, dict) and any(
        isinstance(x.get(k), torch.Tensor) and x[k].ndim == 2
        for k in ("input_ids", "attention_mask")
    )
