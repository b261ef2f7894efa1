"""Rate-limited "still waiting for ..." log lines for long waits.

A wait that lasts more than a few seconds must say what it waits for (which server, which
requests, how many in flight, which workers), so a hang is never silent. Two forms:

- ``WaitLog(logger, every=10.0)``: for polling loops; ``wait_log.tick(describe)`` logs
  ``describe()`` (called only when a line is due) once ``first_after`` seconds have passed
  since the wait started and then every ``every`` seconds.
- ``waiting(logger, describe)``: a context manager for a blocking call (an RPC, a weight
  push); a daemon thread logs ``describe()`` on the same schedule until the block exits.

``fan_out(call, addresses, on_answer, ...)`` is the servers' form: one call per address on
its own thread, each answer handed on as it comes, addresses that leave the rotation not
waited for, and a ``WaitLog`` line naming the ones still out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from areal.infra import stack_dump
from areal.infra.daemon_threads import spawn_daemon

WAIT_LOG_EVERY_S = 10.0
WAIT_LOG_FIRST_S = 5.0


def _text(describe: Callable[[], str] | str) -> str:
    if isinstance(describe, str):
        return describe
    try:
        return describe()
    except Exception as e:  # noqa: BLE001 - a broken description must not break the wait
        return f"<description failed: {type(e).__name__}: {e}>"


class WaitLog:
    """Logs ``still waiting (N s) for <describe()>`` at most every ``every`` seconds."""

    def __init__(
        self,
        logger: Any,
        every: float = WAIT_LOG_EVERY_S,
        first_after: float = WAIT_LOG_FIRST_S,
        level: str = "warning",
        deadline_s: float | None = None,
    ):
        self.logger = logger
        self.every = float(every)
        self.first_after = float(first_after)
        self.level = level
        self.start = time.monotonic()
        self._next = self.start + self.first_after
        self.lines = 0
        # past this, every worker's and server's stacks are dumped once (areal.infra.stack_dump)
        self.deadline_s = deadline_s if deadline_s is not None else stack_dump.hang_deadline_s()
        self.dump_files: list[str] | None = None

    def next_event(self) -> float:
        """Monotonic time of the next line or of the deadline, whichever comes first."""
        if self.deadline_s is None or self.dump_files is not None:
            return self._next
        return min(self._next, self.start + self.deadline_s)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def tick(self, describe: Callable[[], str] | str) -> bool:
        """Log one line if one is due; returns whether it logged."""
        now = time.monotonic()
        if (
            self.deadline_s is not None
            and self.dump_files is None
            and now - self.start >= self.deadline_s
        ):
            self.dump_files = stack_dump.on_wait_deadline(_text(describe), now - self.start)
        if now < self._next:
            return False
        self._next = now + self.every
        self.lines += 1
        getattr(self.logger, self.level)(
            "still waiting (%.0f s) for %s", now - self.start, _text(describe)
        )
        return True


@contextlib.contextmanager
def waiting(
    logger: Any,
    describe: Callable[[], str] | str,
    every: float = WAIT_LOG_EVERY_S,
    first_after: float = WAIT_LOG_FIRST_S,
) -> Iterator[WaitLog]:
    """Log ``describe()`` every ``every`` s (after ``first_after`` s) while the block runs."""
    log = WaitLog(logger, every=every, first_after=first_after)
    done = threading.Event()

    def _run() -> None:
        while not done.wait(max(0.05, log.next_event() - time.monotonic())):
            log.tick(describe)

    ticker = spawn_daemon(_run, name="wait-log")
    try:
        yield log
    finally:
        done.set()
        try:
            ticker.result(timeout=1.0)
        except concurrent.futures.TimeoutError:
            pass
        except Exception as e:  # noqa: BLE001 - the log's failure never fails the block
            logger.warning("the wait log of this block failed: %s: %s", type(e).__name__, e)


def fan_out(
    call: Callable[[str], Any],
    addresses: list[str],
    on_answer: Callable[[str, concurrent.futures.Future], None],
    logger: Any,
    what: str,
    answered: Callable[[], int],
    in_rotation: Callable[[str], bool] | None = None,
) -> None:
    """``call(address)`` for every address concurrently; ``on_answer(address, future)`` for
    each as it finishes (an exception it raises stops the wait and propagates).

    While waiting, an address for which ``in_rotation(address)`` turns false (declared hung
    or dead meanwhile) is not waited for any more, with a warning, and a ``WaitLog`` line
    names the addresses still out, ``what`` they are to answer and ``answered()`` of all.
    The calls run on daemon threads (``spawn_daemon``) that are not waited for at the end:
    a hung server's call must not hold this up.
    """
    futs = {spawn_daemon(call, a, name=f"fan-out {a}"): a for a in addresses}
    pending = set(futs)
    wait_log = WaitLog(logger)
    while pending:
        done, pending = concurrent.futures.wait(pending, timeout=0.5)
        for f in done:
            on_answer(futs[f], f)
        if in_rotation is not None:
            for f in [f for f in pending if not in_rotation(futs[f])]:
                pending.discard(f)
                logger.warning(
                    "not waiting for %s to answer %s any more: it left the rotation",
                    futs[f],
                    what,
                )
        wait_log.tick(
            lambda pending=pending: (
                f"{sorted(futs[f] for f in pending)} to answer {what} "
                f"({answered()} of {len(addresses)} answered)"
            )
        )
