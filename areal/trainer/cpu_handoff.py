"""Cores handed between the trainer and the built-in servers of one CPU machine.

On a CPU machine the trainer and the inference servers share the cores. A built-in server
runs one torch thread (two processes of several OpenMP threads on few cores spin at
every barrier), so while the trainer waits for its batch, or evaluates, every core but
one sits idle: the first step of a run is generation alone, and an asynchronous step
whose training ends before its next batch waits on one core. :class:`CpuThreadHandoff`
gives the servers the idle cores for exactly those waits:

1. ``with handoff.waiting():`` around the batch wait and the evaluation: every server
   gets ``cores // servers`` threads (its next decode step uses them);
2. on leaving it the servers go back to one thread each, before the trainer's own
   threads start on the batch.

It is on when ``rollout.cpu_thread_handoff`` is set, no CUDA device is visible, and every
server is a built-in one on this machine's loopback; a failed call (a server that died)
is logged and the step goes on (the server watchdog restarts dead servers).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from areal.utils import logging

logger = logging.getLogger("CpuThreadHandoff")

_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def _on_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0]
    return host in _LOOPBACK


class CpuThreadHandoff:
    """The servers' threads while the trainer waits (see the module docstring)."""

    def __init__(self, rollout: Any, enabled: bool, cpus: int | None = None):
        import torch

        self.rollout = rollout
        addrs = list(getattr(rollout, "healthy_addresses", None) or [])
        self.cpus = int(cpus or len(os.sched_getaffinity(0)))
        self.idle_threads = max(1, self.cpus // max(1, len(addrs)))
        self.enabled = (
            bool(enabled)
            and not torch.cuda.is_available()
            and bool(addrs)
            and all(_on_loopback(a) for a in addrs)
            and self.idle_threads > 1
            and hasattr(rollout, "set_cpu_threads")
        )
        if self.enabled:
            logger.info(
                "built-in servers use %d threads each while the trainer waits, 1 while it "
                "trains (%d CPUs, %d server(s); rollout.cpu_thread_handoff)",
                self.idle_threads,
                self.cpus,
                len(addrs),
            )

    def _set(self, threads: int) -> None:
        try:
            if not self.rollout.set_cpu_threads(threads):
                self.enabled = False  # a backend whose threads are fixed: stop asking
        except Exception as e:  # a dead server: the watchdog's business, not the step's
            logger.warning("could not set the servers' CPU threads to %d: %s", threads, e)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Servers on ``idle_threads`` inside, one thread after (also on errors)."""
        if not self.enabled:
            yield
            return
        self._set(self.idle_threads)
        try:
            yield
        finally:
            if self.enabled:
                self._set(1)
