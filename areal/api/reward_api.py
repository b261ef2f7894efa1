"""Run synchronous reward functions from async workflows: process pool + timeout.

``AsyncRewardWrapper(reward_fn)`` turns a synchronous, picklable reward function into an
awaitable::

    wrapper = AsyncRewardWrapper(gsm8k_reward_fn, timeout_seconds=15)
    reward = await wrapper(prompt, completion, prompt_ids, completion_ids, answer=answer)

The call runs in a ``ProcessPoolExecutor`` (``spawn`` context; never ``fork``, which is
unsafe with threads and torch) shared by all wrappers with the same ``max_workers``. Its
workers import the training script (``__main__``) only when the call needs it (a reward
function or argument defined there): a reward function of an importable module runs in
workers that import just that module (see "Workers without the script" below). Each
worker exits on its own when the process that created it dies (even by ``kill -9``), so
a crashed controller leaves no reward workers behind. It never blocks the event loop and never raises for a bad
reward: a timeout, an exception in the reward function, or a crashed worker gives 0.0,
a logged warning and a counted event (:meth:`AsyncRewardWrapper.stats`). A reward
function that fails on every call is not a run's reward signal: after
``max_consecutive_errors`` failed calls in a row (no success between them) the next
failure raises :class:`RewardFunctionError` instead, so the episode fails, and the
executor's failure monitor stops the run quoting it.

The timeout measures the reward function's own run, not time spent waiting for a free
worker: at most ``max_workers`` calls per event loop are handed to the pool at once (the
rest wait their turn, unbounded), and a new pool first imports the reward function's
module in a worker (bounded by ``startup_timeout_seconds``). Without this, a burst of
calls (e.g. 512 evaluation episodes) on a busy machine would time out in the queue and
score correct answers 0.

A reward function may carry a fast path for its common cases (:func:`inline_fast_path`,
e.g. ``gsm8k_reward_fn``'s plain-number comparison): the wrapper runs it first, in the
caller's thread, and hands the call to the pool only when it returns ``None``. A pool call
costs about 0.8 ms of the caller's CPU in hand-offs (thread wake-ups, pickling, pipes)
against ~0.02 ms for comparing two numbers.

A call that times out leaves its worker busy, so the pool is replaced at once (its
processes are terminated); calls that were in flight on the old pool get a
``BrokenProcessPool`` and are retried on the new one, so a hanging reward never blocks
later calls.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import multiprocessing
import os
import pickle
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any

from areal.utils import logging

logger = logging.getLogger("RewardAPI")


def reward_fn(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    """Signature of a reward function (documentation only).

    :param prompt: the prompt text.
    :param completions: the generated text.
    :param prompt_ids: prompt token ids.
    :param completion_ids: generated token ids.
    :param kwargs: the other fields of the dataset row (e.g. ``answer``).
    :return: a scalar reward.
    """
    raise NotImplementedError


INLINE_ATTR = "areal_inline_fast_path"


def inline_fast_path(fast: Callable[..., float | None]) -> Callable[[Callable], Callable]:
    """Decorator: give a reward function a fast path for its common cases.

    ``fast`` takes the reward function's arguments and returns the reward, or ``None``
    where only the full function can tell. :class:`AsyncRewardWrapper` runs it in the
    caller's thread before using its worker pool, so it must be cheap and bounded (no
    I/O, no parser that can hang); an exception in it counts as ``None``. The decorated
    function itself is unchanged (and still pickles by name).
    """

    def mark(fn: Callable) -> Callable:
        setattr(fn, INLINE_ATTR, fast)
        return fn

    return mark


# ---------------------------------------------------------------- workers without the script
# CPython's ``spawn`` imports the parent's ``__main__`` (the training script, as
# ``__mp_main__``) in every child, so that objects defined there can be unpickled. For a
# reward function of an importable module that means importing the script's torch and
# trainer for nothing: 4.4-6 CPU-s and a few hundred MB per worker. The context below
# starts workers without it:
#
# 1. ``_NoMainPopen`` marks its thread, then runs the standard spawn launch.
# 2. The launch asks ``multiprocessing.spawn.get_preparation_data`` what the child must
#    set up; a wrapper around it (installed once) drops the ``init_main_from_*`` entries
#    for a marked thread only, so every other spawn, from any thread, is unchanged.
# 3. The child imports only the modules of what it unpickles.
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_marked = threading.local()
_install_lock = threading.Lock()
_installed = False


class _MainFinder(pickle.Pickler):
    """A pickler that notes whether anything it pickles comes from ``__main__``."""

    found = False

    def reducer_override(self, obj):  # called for every non-atomic object, classes too
        if getattr(obj, "__module__", None) == "__main__":
            self.found = True
        return NotImplemented


def refers_to_main(obj: object) -> bool:
    """Whether pickling ``obj`` needs ``__main__`` (a function, class or instance of a class
    of the script), so a worker must import the script to unpickle it; text that merely
    contains "__main__" does not. Unpicklable: True."""
    finder = _MainFinder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        finder.dump(obj)
    except Exception:
        return True
    return finder.found


def _install_preparation_filter() -> None:
    global _installed
    from multiprocessing import spawn

    with _install_lock:
        if _installed:
            return
        original = spawn.get_preparation_data

        def get_preparation_data(name):
            data = original(name)
            if getattr(_marked, "skip_main", False):
                for key in _MAIN_KEYS:
                    data.pop(key, None)
            return data

        spawn.get_preparation_data = get_preparation_data
        _installed = True


if sys.platform != "win32":
    from multiprocessing import context as _mp_ctx
    from multiprocessing import popen_spawn_posix

    class _NoMainPopen(popen_spawn_posix.Popen):
        def _launch(self, process_obj):
            _marked.skip_main = True
            try:
                super()._launch(process_obj)
            finally:
                _marked.skip_main = False

    class _NoMainProcess(_mp_ctx.SpawnProcess):
        @staticmethod
        def _Popen(process_obj):
            return _NoMainPopen(process_obj)

    class _NoMainSpawnContext(_mp_ctx.SpawnContext):
        Process = _NoMainProcess


def _mp_context(with_main: bool):
    # spawn (not forkserver): the workers are children of this process, so they can watch it.
    if with_main or sys.platform == "win32":
        return multiprocessing.get_context("spawn")
    _install_preparation_filter()
    return _NoMainSpawnContext()


def _exit_with_parent(parent_pid: int) -> None:
    """Pool-worker initializer: exit as soon as the creating process is gone."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _import_module_only(name: str) -> None:
    """Pool-worker warm-up: import ``name`` (the module itself is not sent back)."""
    importlib.import_module(name)


def _import_callable(path: str) -> Callable:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"reward_fn={path!r}: expected a dotted path 'package.module.function'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"reward_fn={path!r}: module {module_name!r} has no {attr!r}") from e


def _default_max_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 2))


class RewardFunctionError(RuntimeError):
    """A reward function failed on ``max_consecutive_errors`` calls in a row."""


class AsyncRewardWrapper:
    """Awaitable wrapper around a synchronous reward function.

    Args:
        reward_fn: a picklable (module-level) callable, or its dotted import path.
        timeout_seconds: wall-clock limit of one call once a worker runs it; > 0.
        max_workers: processes of the shared pool (default ``max(1, min(4, cpus // 2))``).
        max_retries: retries after a broken pool (a worker killed or crashed).
        startup_timeout_seconds: limit for a new pool to start a worker and import the
            reward function's module.
        max_consecutive_errors: failed calls in a row (timeouts, exceptions, crashed
            workers, non-numbers) scored 0.0 before a failure raises
            :class:`RewardFunctionError`; ``None``: always 0.0.
    """

    # (max_workers, workers import __main__) -> pool
    _pools: dict[tuple[int, bool], ProcessPoolExecutor] = {}
    # loop -> {max_workers: Semaphore}; weak, so closed loops (asyncio.run) drop out
    _slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()
    _exit_hook_registered = False

    def __init__(
        self,
        reward_fn: Callable | str,
        timeout_seconds: float = 15,
        max_workers: int | None = None,
        max_retries: int = 2,
        startup_timeout_seconds: float = 300,
        max_consecutive_errors: int | None = 32,
    ):
        if max_consecutive_errors is not None and max_consecutive_errors < 1:
            raise ValueError(
                f"max_consecutive_errors must be >= 1 or None, got {max_consecutive_errors}"
            )
        self.max_consecutive_errors = max_consecutive_errors
        self._n_errors_in_a_row = 0
        if isinstance(reward_fn, str):
            reward_fn = _import_callable(reward_fn)
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        try:
            pickle.dumps(reward_fn)
        except Exception as e:
            raise TypeError(
                f"reward_fn {getattr(reward_fn, '__qualname__', reward_fn)!r} is not picklable "
                f"({type(e).__name__}: {e}); it runs in a worker process, so use a "
                "module-level function (not a lambda, closure or bound method of an "
                "unpicklable object)"
            ) from e
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds={timeout_seconds}; must be > 0")
        if max_workers is None:
            max_workers = _default_max_workers()
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}; must be >= 1")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries}; must be >= 0")
        self.reward_fn = reward_fn
        self._fn_refers_to_main = refers_to_main(reward_fn)
        self._fast_path = getattr(reward_fn, INLINE_ATTR, None)
        self.timeout_seconds = float(timeout_seconds)
        self.max_workers = int(max_workers)
        self.max_retries = int(max_retries)
        self.startup_timeout_seconds = float(startup_timeout_seconds)
        self._stat_lock = threading.Lock()
        self._n_calls = 0
        self._n_timeouts = 0
        self._n_errors = 0
        self._register_exit_hook()

    # ------------------------------------------------------------------ pool management
    @classmethod
    def _register_exit_hook(cls) -> None:
        with cls._lock:
            if cls._exit_hook_registered:
                return
            cls._exit_hook_registered = True
        # concurrent.futures joins its workers in a threading-atexit hook; a hanging reward
        # would block interpreter exit there. Ours is registered later, so it runs first.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(cls.shutdown)
        else:  # pragma: no cover - all CPython versions we support have it
            import atexit

            atexit.register(cls.shutdown)

    def _get_pool(self, with_main: bool) -> ProcessPoolExecutor:
        with self._lock:
            key = (self.max_workers, with_main)
            pool = self._pools.get(key)
            if pool is None:
                pool = ProcessPoolExecutor(
                    max_workers=self.max_workers,
                    mp_context=_mp_context(with_main),
                    initializer=_exit_with_parent,
                    initargs=(os.getpid(),),
                )
                self._pools[key] = pool
            return pool

    @staticmethod
    def _kill_pool(pool: ProcessPoolExecutor) -> None:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for p in processes:
            try:
                p.terminate()
            except Exception:  # already gone
                pass
        try:
            pool.shutdown(wait=False, cancel_futures=True)
        except Exception as e:
            logger.debug("Error shutting down reward pool: %s", e)

    def _replace_pool(self, pool: ProcessPoolExecutor, reason: str) -> None:
        """Swap out ``pool`` (if it is still a current one) and terminate its workers."""
        with self._lock:
            key = next((k for k, p in self._pools.items() if p is pool), None)
            if key is None:
                return  # someone else already replaced it
            del self._pools[key]
        logger.warning("Recreating reward process pool (%d workers): %s", self.max_workers, reason)
        self._kill_pool(pool)

    @classmethod
    def shutdown(cls) -> None:
        """Terminate all shared reward pools (they are recreated on the next call)."""
        with cls._lock:
            pools = list(cls._pools.values())
            cls._pools.clear()
        for pool in pools:
            cls._kill_pool(pool)

    # ------------------------------------------------------------------ calls
    def stats(self) -> dict[str, int]:
        """Counters of this wrapper: ``n_calls``, ``n_timeouts``, ``n_errors``."""
        with self._stat_lock:
            return {
                "n_calls": self._n_calls,
                "n_timeouts": self._n_timeouts,
                "n_errors": self._n_errors,
            }

    def _count(self, field: str) -> None:
        with self._stat_lock:
            setattr(self, field, getattr(self, field) + 1)

    def _slot(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        """This loop's limit of calls handed to the pool at once (``max_workers``)."""
        with self._lock:
            per_loop = self._slots.setdefault(loop, {})
            sem = per_loop.get(self.max_workers)
            if sem is None:
                sem = per_loop[self.max_workers] = asyncio.Semaphore(self.max_workers)
            return sem

    async def _warm_up(self, pool: ProcessPoolExecutor, loop) -> None:
        """Start a worker of a new pool and import the reward module (not timed as a call)."""
        module = getattr(self.reward_fn, "__module__", None) or "builtins"
        warm = pool.__dict__.setdefault("_areal_warm_modules", set())
        if module in warm:
            return
        fut = loop.run_in_executor(pool, _import_module_only, module)
        await asyncio.wait_for(fut, timeout=self.startup_timeout_seconds)
        warm.add(module)

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        self._count("_n_calls")
        if self._fast_path is not None:
            value = self._run_fast_path(self._fast_path, args, kwargs)
            if value is not None:
                return value
        loop = asyncio.get_running_loop()
        async with self._slot(loop):
            return await self._call(loop, *args, **kwargs)

    async def _call(self, loop, *args: Any, **kwargs: Any) -> float:
        name = getattr(self.reward_fn, "__qualname__", repr(self.reward_fn))
        last_error: BaseException | None = None
        with_main = self._fn_refers_to_main or refers_to_main((args, kwargs))
        for attempt in range(self.max_retries + 1):
            pool = self._get_pool(with_main)
            try:
                await self._warm_up(pool, loop)
                fut = loop.run_in_executor(pool, partial(self.reward_fn, *args, **kwargs))
                result = await asyncio.wait_for(fut, timeout=self.timeout_seconds)
            except TimeoutError:
                self._count("_n_timeouts")
                self._replace_pool(pool, f"a call to {name} timed out")
                return self._failed(name, f"timed out after {self.timeout_seconds:.1f}s")
            except BrokenProcessPool as e:
                last_error = e
                self._replace_pool(pool, f"broken pool ({e})")
                logger.warning(
                    "Reward %s: worker pool broken (attempt %d/%d)",
                    name,
                    attempt + 1,
                    self.max_retries + 1,
                )
                continue
            except RuntimeError as e:
                # A pool shut down under us ("cannot schedule new futures after shutdown").
                if "shutdown" in str(e) and attempt < self.max_retries:
                    last_error = e
                    continue
                self._count("_n_errors")
                return self._failed(name, f"raised {e!r}")
            except asyncio.CancelledError as e:
                task = asyncio.current_task()
                if (task is not None and task.cancelling()) or attempt >= self.max_retries:
                    raise  # this episode itself is being cancelled
                # The pool was replaced under this call (another call timed out) and its
                # queued work cancelled: retry on the new pool.
                last_error = e
                continue
            except Exception as e:
                self._count("_n_errors")
                return self._failed(name, f"raised {e!r}")
            try:
                value = float(result)
            except (TypeError, ValueError) as e:
                self._count("_n_errors")
                return self._failed(name, f"returned {result!r}, which is not a number ({e})")
            with self._stat_lock:
                self._n_errors_in_a_row = 0
            return value
        self._count("_n_errors")
        return self._failed(name, f"failed after {self.max_retries + 1} attempts ({last_error!r})")

    def _run_fast_path(self, fast: Callable, args: tuple, kwargs: dict) -> float | None:
        """The reward from the function's inline fast path, or None (use the pool)."""
        try:
            result = fast(*args, **kwargs)
            value = None if result is None else float(result)
        except Exception as e:
            logger.debug("Reward fast path %r failed (%r); using the pool", fast, e)
            return None
        if value is not None:
            with self._stat_lock:
                self._n_errors_in_a_row = 0
        return value

    def _failed(self, name: str, what: str) -> float:
        """0.0 for a failed call (logged), or :class:`RewardFunctionError` once
        ``max_consecutive_errors`` calls in a row have failed."""
        with self._stat_lock:
            self._n_errors_in_a_row += 1
            in_a_row = self._n_errors_in_a_row
        limit = self.max_consecutive_errors
        if limit is not None and in_a_row > limit:
            raise RewardFunctionError(
                f"reward function {name} failed on {in_a_row} calls in a row, the last "
                f"{what}; a reward that always fails gives no signal to train on (fix it, "
                f"or raise AsyncRewardWrapper's max_consecutive_errors)"
            )
        logger.warning("Reward %s %s; reward 0.0", name, what)
        return 0.0
