"""Stack dumps of every worker and server when a wait passes its deadline (or on SIGUSR1).

Every process the run starts (RPC workers, inference servers) calls
``install_process_handler(role)`` at start: when ``AREAL_STACK_DUMP_DIR`` is set it opens
``<dir>/<role>-<pid>.stacks`` and registers ``faulthandler`` for ``DUMP_SIGNAL`` with
``all_threads=True``. faulthandler's handler is C code run in the signal handler: it writes
the Python stacks of all threads without taking the GIL, so a process stuck in native code
that holds the GIL (no Python thread of it can run) still answers.

The controller calls ``enable(dir)`` before it starts any process (the children inherit the
directory through the environment). From then on:

- a ``WaitLog`` wait (rollout, RPC calls, weight push, collective joins, health checks)
  that passes the deadline (``AREAL_HANG_DUMP_AFTER_S``, default 300 s) calls
  ``on_wait_deadline``: the controller writes its own stacks, signals every process that
  registered a file in the directory, waits up to ``ANSWER_WAIT_S`` for the files to grow
  and logs a warning naming the files;
- ``SIGUSR1`` to the controller does the same at once.

Only processes on the controller's host are reached (the signal is local); a process of
another host writes its file there but is not signalled.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import threading
import time
from typing import IO

from areal.utils import logging

logger = logging.getLogger("StackDump")

STACK_DUMP_DIR_ENV = "AREAL_STACK_DUMP_DIR"
HANG_DUMP_AFTER_ENV = "AREAL_HANG_DUMP_AFTER_S"
DEFAULT_HANG_DUMP_AFTER_S = 300.0
DUMP_SIGNAL = signal.SIGUSR2
ANSWER_WAIT_S = 5.0
MIN_INTERVAL_S = 30.0  # several waits passing their deadline together make one dump

_FILE_RE = re.compile(r"^(?P<role>[A-Za-z0-9_.]+)-(?P<pid>\d+)\.stacks$")
_open_files: list[IO[str]] = []  # kept open for faulthandler's C handler
_lock = threading.Lock()
_last_dump = -float("inf")
_controller_signal_old = None


def dump_dir() -> str | None:
    return os.environ.get(STACK_DUMP_DIR_ENV) or None


def hang_deadline_s() -> float | None:
    """Seconds after which a wait dumps stacks; None when dumps are not enabled."""
    if dump_dir() is None:
        return None
    raw = os.environ.get(HANG_DUMP_AFTER_ENV, "")
    if not raw:
        return DEFAULT_HANG_DUMP_AFTER_S
    try:
        value = float(raw)
    except ValueError as e:
        raise ValueError(
            f"{HANG_DUMP_AFTER_ENV}={raw!r} is not a number (seconds > 0 allowed)"
        ) from e
    if value <= 0:
        raise ValueError(f"{HANG_DUMP_AFTER_ENV}={raw!r}: seconds > 0 allowed")
    return value


def install_process_handler(role: str, directory: str | None = None) -> str | None:
    """Register the all-threads faulthandler dump on ``DUMP_SIGNAL``; returns its file."""
    if not re.fullmatch(r"[A-Za-z0-9_.]+", role):
        raise ValueError(f"role={role!r}: letters, digits, '_' and '.' allowed")
    directory = directory or dump_dir()
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{role}-{os.getpid()}.stacks")
    f = open(path, "a", buffering=1)  # noqa: SIM115 - must stay open for the C handler
    _open_files.append(f)
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return path


def enable(directory: str, after_s: float | None = None, on_sigusr1: bool = True) -> None:
    """Controller side: the directory for every process started from now on (inherited
    environment), the wait deadline and, from the main thread, the SIGUSR1 handler."""
    global _controller_signal_old
    os.makedirs(directory, exist_ok=True)
    os.environ[STACK_DUMP_DIR_ENV] = os.path.abspath(directory)
    if after_s is not None:
        if after_s <= 0:
            raise ValueError(f"after_s={after_s!r}: seconds > 0 allowed")
        os.environ[HANG_DUMP_AFTER_ENV] = str(float(after_s))
    if (
        on_sigusr1
        and _controller_signal_old is None
        and threading.current_thread() is threading.main_thread()
    ):
        _controller_signal_old = signal.signal(signal.SIGUSR1, _on_sigusr1)


def disable() -> None:
    """Undo ``enable`` (and forget the last dump's time, so the next one is not held back)."""
    global _controller_signal_old, _last_dump
    _last_dump = -float("inf")
    os.environ.pop(STACK_DUMP_DIR_ENV, None)
    os.environ.pop(HANG_DUMP_AFTER_ENV, None)
    if _controller_signal_old is not None:
        signal.signal(signal.SIGUSR1, _controller_signal_old)
        _controller_signal_old = None


def _on_sigusr1(_signum, _frame) -> None:
    # Do the work off the signal handler (it may have interrupted a lock holder).
    threading.Thread(
        target=lambda: _log_dump("SIGUSR1", dump_all("SIGUSR1", force=True)),
        name="stack-dump",
        daemon=True,
    ).start()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def dump_all(reason: str, force: bool = False) -> list[str]:
    """Write the controller's stacks, signal every registered process; the files written."""
    global _last_dump
    directory = dump_dir()
    if directory is None:
        return []
    with _lock:
        now = time.monotonic()
        if not force and now - _last_dump < MIN_INTERVAL_S:
            return []
        _last_dump = now
        header = f"\n=== stack dump ({reason}) at {time.strftime('%Y-%m-%dT%H:%M:%S')} ===\n"
        own = os.path.join(directory, f"controller-{os.getpid()}.stacks")
        with open(own, "a") as f:
            f.write(header)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        sizes: dict[str, int] = {}
        for name in sorted(os.listdir(directory)):
            m = _FILE_RE.match(name)
            if m is None or int(m["pid"]) == os.getpid() or m["role"] == "controller":
                continue
            pid, path = int(m["pid"]), os.path.join(directory, name)
            if not _pid_alive(pid):
                continue
            with open(path, "a") as f:
                f.write(header)
            sizes[path] = os.path.getsize(path)
            try:
                os.kill(pid, DUMP_SIGNAL)
            except OSError:
                sizes.pop(path)
        deadline = time.monotonic() + ANSWER_WAIT_S
        answered: list[str] = []
        while sizes and time.monotonic() < deadline:
            for path in [p for p, s in sizes.items() if os.path.getsize(p) > s]:
                answered.append(path)
                sizes.pop(path)
            if sizes:
                time.sleep(0.05)
        if sizes:
            logger.warning("no stack dump within %.0f s from %s", ANSWER_WAIT_S, sorted(sizes))
        return [own, *sorted(answered)]


def _log_dump(reason: str, files: list[str]) -> None:
    if files:
        logger.warning("%s: Python stacks (all threads) written to %s", reason, files)


def on_wait_deadline(what: str, elapsed: float) -> list[str]:
    """A wait passed its deadline: dump every process's stacks and name the files."""
    try:
        files = dump_all(f"waited {elapsed:.0f} s for {what}")
    except OSError as e:  # a failing dump must not break the wait itself
        logger.warning("stack dump failed: %s: %s", type(e).__name__, e)
        return []
    _log_dump(f"waited {elapsed:.0f} s (past the deadline) for {what}", files)
    return files
