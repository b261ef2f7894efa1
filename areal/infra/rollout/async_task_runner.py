"""``AsyncTaskRunner``: run async functions on a background event loop (AReaL's interface).

A small general-purpose runner for code written against AReaL's
``areal.infra.rollout.async_task_runner``::

    runner = AsyncTaskRunner(max_queue_size=64)
    runner.initialize()
    runner.submit(some_async_fn, arg, task_id=1, key=value)
    results = runner.wait(count=1, timeout=30)   # [value returned by some_async_fn]
    runner.destroy()

Semantics (as AReaL's): one daemon thread owns an asyncio loop; ``submit`` enqueues
(``TaskQueueFullError`` when ``max_queue_size`` inputs wait, ``ValueError`` for a
``task_id`` still queued or running); a task that raises or is cancelled yields ``None``
(logged); ``wait(count)`` returns ``count`` results in completion order (``TimedResult``
objects with ``with_timing=True``); ``pause()`` stops starting queued tasks (running ones
finish). The rollout path of this project uses :class:`~areal.infra.rollout.workflow_executor.
WorkflowExecutor`, which has its own loop; this runner is for user code.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from areal.utils import logging

__all__ = ["AsyncTaskRunner", "TaskQueueFullError", "TimedResult"]

T = TypeVar("T")
_WAIT_SLICE_S = 0.1


class TaskQueueFullError(RuntimeError):
    """The runner's input (or output) queue is full."""


@dataclass
class TimedResult(Generic[T]):
    """A result with the ``time.monotonic_ns()`` at which its task was created."""

    create_time: int
    data: T
    task_id: int


@dataclass
class _Input:
    fn: Callable[..., Awaitable[Any]]
    args: tuple
    kwargs: dict
    task_id: int


class AsyncTaskRunner(Generic[T]):
    """Background asyncio runner with bounded queues and pause/resume (see module doc)."""

    def __init__(
        self,
        max_queue_size: int,
        poll_wait_time: float = 0.05,
        poll_sleep_time: float = 0.5,
        enable_tracing: bool = False,
    ):
        if int(max_queue_size) < 1:
            raise ValueError(f"max_queue_size={max_queue_size}; must be >= 1")
        self.max_queue_size = int(max_queue_size)
        self.poll_wait_time = poll_wait_time
        self.poll_sleep_time = poll_sleep_time
        self.enable_tracing = enable_tracing
        self.input_queue: queue.Queue[_Input] = queue.Queue(maxsize=self.max_queue_size)
        self.output_queue: queue.Queue[TimedResult[T]] = queue.Queue(maxsize=self.max_queue_size)
        self.exiting = threading.Event()
        self.paused = threading.Event()
        self.logger = logging.getLogger("AsyncTaskRunner")
        self.thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._active: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, logger: Any = None) -> None:
        """Start the background thread and its event loop."""
        if logger is not None:
            self.logger = logger
        if self.thread is not None:
            return
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self._thread_main, args=(ready,), name="AsyncTaskRunner", daemon=True
        )
        self.thread.start()
        if not ready.wait(timeout=10):
            raise RuntimeError("AsyncTaskRunner: the event loop did not start")

    def destroy(self, timeout: float = 30.0) -> None:
        """Cancel running tasks and stop the thread."""
        self.exiting.set()
        self._signal()
        if self.thread is not None:
            self.thread.join(timeout=timeout)
            if self.thread.is_alive():
                self.logger.warning("AsyncTaskRunner thread did not stop within %.0f s", timeout)
            self.thread = None

    # ------------------------------------------------------------------ API
    def submit(
        self, async_fn: Callable[..., Awaitable[T]], *args: Any, task_id: int, **kwargs: Any
    ) -> int:
        """Enqueue ``async_fn(*args, **kwargs)``; returns ``task_id``."""
        self._check_health()
        with self._lock:
            if task_id in self._active:
                raise ValueError(f"Duplicate task_id {task_id}: it is still queued or running")
            self._active.add(task_id)
        try:
            self.input_queue.put_nowait(_Input(async_fn, args, kwargs, task_id))
        except queue.Full:
            with self._lock:
                self._active.discard(task_id)
            raise TaskQueueFullError(
                f"Input queue full ({self.max_queue_size}): raise max_queue_size or wait() first"
            ) from None
        self._signal()
        return task_id

    def wait(
        self, count: int, timeout: float | None = None, with_timing: bool = False
    ) -> list[Any]:
        """Block until ``count`` results arrived (completion order); ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        out: list[TimedResult[T]] = []
        while len(out) < count:
            self._check_health()
            if self.exiting.is_set():
                raise RuntimeError("AsyncTaskRunner is exiting, cannot wait for results")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"Timed out waiting for {count} results, only received {len(out)}"
                )
            try:
                out.append(
                    self.output_queue.get(
                        timeout=_WAIT_SLICE_S
                        if remaining is None
                        else min(remaining, _WAIT_SLICE_S)
                    )
                )
            except queue.Empty:
                continue
        return out if with_timing else [r.data for r in out]

    def pause(self) -> None:
        """Stop starting queued tasks; running ones continue."""
        self.paused.set()

    def resume(self) -> None:
        self.paused.clear()
        self._signal()

    def get_queue_sizes(self) -> tuple[int, int]:
        return self.input_queue.qsize(), self.output_queue.qsize()

    def get_input_queue_size(self) -> int:
        return self.input_queue.qsize()

    def get_output_queue_size(self) -> int:
        return self.output_queue.qsize()

    # ------------------------------------------------------------------ internals
    def _check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"AsyncTaskRunner thread died: {self._error!r}") from self._error
        if self.thread is None or not self.thread.is_alive():
            raise RuntimeError("AsyncTaskRunner is not running: call initialize() first")

    def _signal(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass

    def _thread_main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(ready))
        except BaseException as e:  # noqa: BLE001 - surfaced to callers by _check_health
            self._error = e
            self.logger.error("AsyncTaskRunner loop crashed: %r", e)
        finally:
            self._loop = self._wake = None
            loop.close()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        ready.set()
        running: dict[asyncio.Task, tuple[int, int]] = {}
        try:
            while not self.exiting.is_set():
                while not self.paused.is_set():
                    try:
                        item = self.input_queue.get_nowait()
                    except queue.Empty:
                        break
                    task = asyncio.ensure_future(item.fn(*item.args, **item.kwargs))
                    running[task] = (item.task_id, time.monotonic_ns())
                    if self.enable_tracing:
                        self.logger.info("Started task %d (%d running)", item.task_id, len(running))
                if not running:
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=self.poll_sleep_time)
                    except TimeoutError:
                        pass
                    self._wake.clear()
                    continue
                done, _ = await asyncio.wait(
                    list(running), timeout=self.poll_wait_time, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    tid, created = running.pop(task)
                    self._finish(task, tid, created)
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    def _finish(self, task: asyncio.Task, tid: int, created: int) -> None:
        result = None
        if task.cancelled():
            self.logger.warning("Task %d was cancelled; its result is None", tid)
        elif task.exception() is not None:
            self.logger.error("Task %d failed; its result is None", tid, exc_info=task.exception())
        else:
            result = task.result()
        with self._lock:
            self._active.discard(tid)
        try:
            self.output_queue.put_nowait(TimedResult(created, result, tid))
        except queue.Full:
            raise TaskQueueFullError(
                f"Output queue full ({self.max_queue_size}): call wait() or raise max_queue_size"
            ) from None
