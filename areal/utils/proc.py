"""Process-tree helpers (AReaL's ``kill_process_tree``)."""

from __future__ import annotations

import os

import psutil

from areal.utils import logging

__all__ = ["kill_process_tree"]

logger = logging.getLogger("Proc")


def kill_process_tree(
    parent_pid: int | None = None,
    timeout: float = 5,
    include_parent: bool = True,
    skip_pid: int | None = None,
    graceful: bool = True,
) -> None:
    """Terminate ``parent_pid`` (default: this process) and all its descendants.

    ``graceful``: SIGTERM first, SIGKILL whatever is still alive after ``timeout``
    seconds; otherwise SIGKILL at once. ``skip_pid`` is spared. Never kills this process
    unless it is ``parent_pid`` with ``include_parent``.
    """
    pid = os.getpid() if parent_pid is None else int(parent_pid)
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True)
    if include_parent:
        procs.append(parent)
    procs = [p for p in procs if p.pid != skip_pid]
    if parent_pid is None:
        procs = [p for p in procs if p.pid != os.getpid()]
    for p in procs:
        try:
            p.terminate() if graceful else p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout if graceful else 1)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=timeout)
        logger.info("Killed %d process(es) that ignored SIGTERM", len(alive))
