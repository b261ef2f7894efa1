"""``spawn_daemon(fn, *args, **kwargs) -> Future``: run one call on a daemon thread,
reusing threads that finished their call.

Why daemon threads and not ``ThreadPoolExecutor``: the executor's threads are joined at
interpreter exit and its pool has a fixed size, so a call stuck on a hung peer (an RPC
worker, an inference server) would keep the controller from exiting, or starve the calls
queued behind it. Here a call never waits for a thread: a hung call holds only its own.

Why reuse: starting a thread makes the caller wait until the new thread holds the GIL;
in a busy controller (HTTP relays and reward scoring on other threads) that measured
about 5 ms per start, and a training step makes a dozen such calls.

1. ``spawn_daemon`` takes an idle thread when one is parked (``_idle`` counts them) and
   otherwise starts a new daemon thread; either way the call goes on the shared queue.
2. A thread runs a call under the caller's ``name`` (thread dumps stay readable),
   delivers its result or exception through the Future, then parks: ``_idle`` += 1 and a
   wait on the queue.
3. A thread parked for ``IDLE_EXIT_S`` with nobody having claimed it exits; one that was
   claimed meanwhile (``_idle`` already taken back) stays for the call on its way.

Invariant: the threads waiting on the queue = ``_idle`` + the calls in the queue, so every
queued call has a thread to run it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

IDLE_EXIT_S = 60.0

_calls: queue.SimpleQueue = queue.SimpleQueue()
_lock = threading.Lock()
_idle = 0


def spawn_daemon(fn: Callable[..., Any], *args, name: str = "rpc-call", **kwargs) -> Future:
    """Run ``fn(*args, **kwargs)`` on a daemon thread; its result or exception comes back
    through the returned Future (module docstring)."""
    global _idle
    fut: Future = Future()
    with _lock:
        start = _idle == 0
        if not start:
            _idle -= 1
    _calls.put((fn, args, kwargs, fut, name))
    if start:
        threading.Thread(target=_serve, name=name, daemon=True).start()
    return fut


def _serve() -> None:
    global _idle
    me = threading.current_thread()
    while True:
        try:
            fn, args, kwargs, fut, name = _calls.get(timeout=IDLE_EXIT_S)
        except queue.Empty:
            with _lock:
                if _idle > 0:  # nobody claimed a parked thread: one of them leaves
                    _idle -= 1
                    return
            continue  # claimed: the call is on its way
        me.name = name
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)
        del fn, args, kwargs, fut  # a parked thread keeps no reference to the last call
        me.name = "daemon-idle"
        with _lock:
            _idle += 1


def idle_threads() -> int:
    """Threads parked for a next call (for tests and diagnostics)."""
    with _lock:
        return _idle
