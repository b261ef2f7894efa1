"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, ``kill``, Ctrl-C).

``StopOnSignal().install()`` replaces the handlers in the main thread: the first signal
only sets ``requested`` and the ``event`` (a ``threading.Event``). ``PPOTrainer`` hands the
event to the rollout executor (``interrupt_waits_on``), so a wait for a batch ends within
a fraction of a second (``WaitInterrupted``) and the recover checkpoint of the last
completed step is written; a step past its rollout (training, weight sync) finishes first
and writes its own. ``PPOTrainer.train`` then raises ``SystemExit(128 + signum)`` so the
trainer's ``close()`` tears every child down. A second signal raises
``KeyboardInterrupt`` at once (still unwinding through ``close()``). ``uninstall()``
restores the previous handlers.
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
        #: set by the first signal (waits that watch it end at once)
        self.event = threading.Event()
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
        self.event.set()
        logger.warning(
            f"{signal.Signals(signum).name} received: stopping (a wait for a batch ends now, "
            "a step past its rollout finishes first; the recover checkpoint of the last "
            "completed step is written); send it again to stop at once"
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
