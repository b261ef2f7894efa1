"""AReaL's performance-tracing API, so that instrumented user code runs unchanged.

Decorators and context managers (``trace_perf``, ``trace_scope`` / ``atrace_scope``,
``session_context``, ``trace_session``, ``trace_session_phase`` /
``atrace_session_phase``, ``trace_session_event``, ``instant``) cost nothing until
:func:`configure` is called with an enabled config; then every span is kept as a Chrome
trace event (``ph: X``, microseconds) and :func:`save` writes them as JSON to
``{save_dir}/perf_trace_rank{rank}.json`` (open in ``chrome://tracing`` or Perfetto), and
:func:`flush` appends the events recorded since its last call, one JSON object a line, to
``{save_dir}/traces-r{rank}.jsonl`` (what the trainers do: ``perf_tracer.enabled`` in the
YAML, files under ``{log_dir}/perf_tracer``, flushed every ``save_interval`` steps;
``python -m areal.tools.perf_trace_converter`` merges them into one trace file).
Session metrics (AReaL's session tracer) are not computed: session phases are plain
spans.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal.api.utils_config import PerfTracerConfig

__all__ = [
    "Category",
    "atrace_scope",
    "atrace_session_phase",
    "configure",
    "flush",
    "get_task_id",
    "instant",
    "is_configured",
    "register_task",
    "reset",
    "save",
    "session_context",
    "set_task_id",
    "trace_perf",
    "trace_scope",
    "trace_session",
    "trace_session_event",
    "trace_session_phase",
]


class Category(enum.StrEnum):
    """Span categories (AReaL's ``PerfTraceCategory``)."""

    COMPUTE = "compute"
    COMM = "comm"
    IO = "io"
    SYNC = "sync"
    SCHEDULER = "scheduler"
    INSTR = "instr"
    MISC = "misc"


PerfTraceCategory = Category

_lock = threading.Lock()
_events: list[dict[str, Any]] = []
_state: dict[str, Any] = {"enabled": False, "rank": 0, "save_dir": None, "flushed": 0}
_task_id: ContextVar[int | None] = ContextVar("areal_perf_task_id", default=None)


def configure(
    config: PerfTracerConfig | None = None, rank: int = 0, save_dir: str | None = None
) -> None:
    """Turn tracing on when ``config.enabled`` (a ``PerfTracerConfig``) is true.

    ``save_dir`` defaults to ``{fileroot}/logs/{experiment_name}/{trial_name}`` read from
    ``config`` (or the current directory).
    """
    enabled = config is not None and bool(config.enabled)
    if save_dir is None and config is not None:
        parts = [config.fileroot, config.experiment_name, config.trial_name]
        if all(parts):
            save_dir = os.path.join(parts[0], "logs", parts[1], parts[2])
    with _lock:
        _state.update(
            enabled=enabled, rank=int(rank), save_dir=save_dir or os.getcwd(), flushed=len(_events)
        )


def is_configured() -> bool:
    return bool(_state["enabled"])


def reset() -> None:
    """Drop recorded events and turn tracing off."""
    with _lock:
        _events.clear()
        _state.update(enabled=False, rank=0, save_dir=None, flushed=0)


def _category(category: Any) -> str:
    if category is None:
        return Category.MISC.value
    return category.value if isinstance(category, Category) else str(category)


def _record(name: str, category: Any, start: float, end: float | None, args: Any) -> None:
    if not _state["enabled"]:
        return
    ev: dict[str, Any] = {
        "name": name,
        "cat": _category(category),
        "ts": start * 1e6,
        "pid": _state["rank"],
        "tid": threading.get_ident(),
    }
    if end is None:
        ev.update(ph="i", s="t")
    else:
        ev.update(ph="X", dur=(end - start) * 1e6)
    extra = dict(args or {})
    tid = _task_id.get()
    if tid is not None:
        extra.setdefault("task_id", tid)
    if extra:
        ev["args"] = {
            k: v if isinstance(v, int | float | str | bool) else repr(v) for k, v in extra.items()
        }
    with _lock:
        _events.append(ev)


@contextlib.contextmanager
def trace_scope(name: str, category: Any = None, args: dict[str, Any] | None = None):
    """Span around a block: ``with trace_scope("step", Category.COMPUTE): ...``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _record(name, category, start, time.perf_counter(), args)


@contextlib.asynccontextmanager
async def atrace_scope(name: str, category: Any = None, args: dict[str, Any] | None = None):
    """Async span: ``async with atrace_scope("tool", Category.IO): ...``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _record(name, category, start, time.perf_counter(), args)


def instant(name: str, category: Any = None, args: dict[str, Any] | None = None) -> None:
    """A point event."""
    _record(name, category, time.perf_counter(), None, args)


def trace_perf(name: str, *, category: Any = None) -> Callable[[Callable], Callable]:
    """Decorate a function (sync or async) so each call is a span named ``name``."""

    def deco(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*a, **kw):
                async with atrace_scope(name, category):
                    return await fn(*a, **kw)

            return awrapper

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            with trace_scope(name, category):
                return fn(*a, **kw)

        return wrapper

    return deco


def trace_session_phase(phase: str):
    """Span for one phase (``generate``, ``reward``, ``toolcall``, ...) of a session."""
    return trace_scope(f"session.{phase}", Category.INSTR)


def atrace_session_phase(phase: str):
    return atrace_scope(f"session.{phase}", Category.INSTR)


def trace_session(phase: str) -> Callable[[Callable], Callable]:
    """Decorator form of :func:`trace_session_phase` (sync or async functions)."""
    return trace_perf(f"session.{phase}", category=Category.INSTR)


def session_context() -> Callable[[Callable], Callable]:
    """Decorator marking one session (one sample); spans inside carry the task id."""

    def deco(fn: Callable) -> Callable:
        return trace_perf(f"session.{fn.__name__}", category=Category.INSTR)(fn)

    return deco


def trace_session_event(name: str, **fields: Any) -> None:
    """Lifecycle event of a session (e.g. ``mark_finalized``), kept as an instant event."""
    instant(f"session_event.{name}", Category.INSTR, fields)


def set_task_id(task_id: int | None) -> None:
    _task_id.set(task_id)


def get_task_id() -> int | None:
    return _task_id.get()


def register_task(task_id: int) -> None:
    """Accepted for AReaL compatibility (tasks need no registration here)."""


def save(*, step: int | None = None, force: bool = False) -> str | None:
    """Write the recorded events (Chrome trace JSON); returns the path, or None when off."""
    if not _state["enabled"]:
        return None
    with _lock:
        events = list(_events)
    os.makedirs(_state["save_dir"], exist_ok=True)
    path = os.path.join(_state["save_dir"], f"perf_trace_rank{_state['rank']}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def jsonl_path() -> str | None:
    """The file :func:`flush` appends to (``None`` when tracing is off)."""
    if not _state["enabled"]:
        return None
    return os.path.join(_state["save_dir"], f"traces-r{_state['rank']}.jsonl")


def flush() -> str | None:
    """Append the events recorded since the last flush to :func:`jsonl_path` (one JSON
    object a line); returns the path, or ``None`` when tracing is off."""
    path = jsonl_path()
    if path is None:
        return None
    with _lock:
        events = _events[_state["flushed"] :]
        _state["flushed"] = len(_events)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for ev in events:
            f.write(json.dumps(ev) + "\n")
    return path
