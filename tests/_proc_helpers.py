"""Helpers for tests that check a component leaves no child processes behind."""

from __future__ import annotations

import time

import psutil

_MP_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "multiprocessing.spawn",
)


def _is_python_mp_helper(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker / forkserver / pool workers of other tests."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return any(m in cmd for m in _MP_HELPERS)


def _started_before(proc: psutil.Process, t: float) -> bool:
    try:
        return proc.create_time() < t
    except psutil.Error:
        return True


def leftover_children(since: float, exclude_pids: set[int] = frozenset()) -> list[psutil.Process]:
    """Live children of this process started after ``since`` (minus helpers and ``exclude_pids``)."""
    kids = []
    for c in psutil.Process().children(recursive=True):
        try:
            zombie = c.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
        if c.pid in exclude_pids or zombie or _is_python_mp_helper(c) or _started_before(c, since):
            continue
        kids.append(c)
    return kids


def now_minus(seconds: float = 0.5) -> float:
    return time.time() - seconds
