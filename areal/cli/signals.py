"""Waiting in the foreground until SIGTERM / SIGINT (the ``run`` verbs' watcher)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


def wait_until_signalled(alive: Callable[[], bool], poll_s: float = 0.5) -> str:
    """Block until SIGTERM / SIGINT arrives or ``alive()`` turns false.

    Returns ``"signal"`` or ``"exited"``. The previous handlers are restored."""
    stop = threading.Event()

    def _handler(signum, frame):  # noqa: ARG001
        stop.set()

    old = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(poll_s):
            if not alive():
                return "exited"
        return "signal"
    finally:
        for s, h in old.items():
            signal.signal(s, h)
