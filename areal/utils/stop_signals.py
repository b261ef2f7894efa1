"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, ``kill``, Ctrl-C).

``StopOnSignal().install()`` replaces the handlers in the main thread: the first signal
only sets ``requested`` (the training loop finishes its step, writes a recover checkpoint
and stops; ``PPOTrainer.train`` then raises ``SystemExit(128 + signum)`` so the trainer's
``close()`` tears every child down); a second signal raises ``KeyboardInterrupt`` at once
(still unwinding through ``close()``). ``uninstall()`` restores the previous handlers.
"""

from __future__ import annotations

import signal
import threading

from areal.utils import logging

logger = logging.getLogger("StopOnSignal")


class StopOnSignal:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            logger.warning(f"{signal.Signals(signum).name} again: stopping now")
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning(
            f"{signal.Signals(signum).name} received: stopping after the current step "
            "(a recover checkpoint is written first); send it again to stop at once"
        )

    def install(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread() and not self._old:
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
