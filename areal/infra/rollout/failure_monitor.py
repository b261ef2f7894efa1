"""``EpisodeFailureMonitor``: stop a run whose episodes keep failing, or keep giving nothing.

A *failure* is an episode that could not produce a result: its workflow raised (an
exception of its own, an HTTP error a server answered, e.g. 400 for a prompt longer than
the model's context), its trajectory was malformed, or the accept filter raised. A
*rejection* (the workflow returned ``None``, a dynamic-sampling filter said no, a stale
result) is a legitimate outcome and counts as a finished episode, not as a failure.
Episodes cancelled or re-queued because no server was in rotation count as neither.
A run can still starve on rejections alone (a dynamic-sampling filter that drops every
group, because all of a group's rewards are equal: the task too hard or too easy for the
model; a workflow that always returns ``None``): the batch never fills. So the rejections
that give nothing (``none``, ``filtered``; not ``stale``, whose rows are generated again)
are counted in a row as well, and reset by the next accepted episode.

For every finished episode, in order:

1. ``record_ok(rejected=None)`` / ``record_failure(exc)``: the outcome enters a window of the last
   ``window`` outcomes; a failure is described as ``ExceptionType: message`` (the first
   300 characters; an HTTP error's status and body excerpt are part of its message) and
   grouped with the failures whose description differs only in numbers (ports, token
   counts);
2. the monitor trips, once and for good, when the last ``max_consecutive`` outcomes all
   failed, or when the window is full and more than ``max_ratio`` of it failed, or when the
   last ``max_consecutive_rejections`` finished episodes were all rejected with a reason
   that gives nothing (``rejected="filtered"`` / ``"none"``) and none was accepted;
3. ``raise_if_tripped()`` (called by every wait of the executor, and by evaluation) then
   raises :class:`RolloutFailureError` whose message names the rule that tripped (and the
   config field that sets it), the most common failure, how often it occurred out of how
   many finished episodes, and an example of it verbatim; after a finite set of episodes
   (an evaluation), ``raise_if_all_failed()`` raises it too when every one failed;
4. ``take_failed()``: failures since the last call, for the ``rollout/n_failed`` stat.

Thread-safe: the executor's loop records, the trainer's thread checks.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, deque

__all__ = ["EpisodeFailureMonitor", "RolloutFailureError", "describe_failure"]

_MAX_DESCRIPTION = 300
#: rejection reasons of a finished episode that gave nothing to train on
_GIVES_NOTHING = frozenset({"filtered", "none"})


class RolloutFailureError(RuntimeError):
    """Episodes keep failing: the run stops instead of resubmitting forever."""


def describe_failure(exc: BaseException) -> str:
    """``ExceptionType: message`` (at most 300 characters of the message)."""
    msg = " ".join(str(exc).split())
    if len(msg) > _MAX_DESCRIPTION:
        msg = msg[:_MAX_DESCRIPTION] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _group_key(description: str) -> str:
    return re.sub(r"\d+", "N", description)


class EpisodeFailureMonitor:
    """Counts failed episodes over a window and trips (module docstring).

    Args:
        kind: what the episodes are (``"training"``, ``"evaluation"``), for the message.
        max_consecutive: trip when this many outcomes in a row failed; None: never.
        window: the number of last outcomes the share is measured over.
        max_ratio: trip when more than this share of a full window failed; None: never.
        field_prefix: where the settings live in the config, for the message.
        max_consecutive_rejections: trip when this many finished episodes in a row were
            rejected as ``filtered`` or ``none`` (no accepted one between); None: never.
    """

    def __init__(
        self,
        kind: str,
        max_consecutive: int | None,
        window: int,
        max_ratio: float | None,
        field_prefix: str = "rollout.",
        max_consecutive_rejections: int | None = None,
    ):
        if max_consecutive is not None and max_consecutive < 1:
            raise ValueError(f"max_consecutive={max_consecutive}; must be >= 1 or None")
        if max_consecutive_rejections is not None and max_consecutive_rejections < 1:
            raise ValueError(
                f"max_consecutive_rejections={max_consecutive_rejections}; must be >= 1 or None"
            )
        if window < 1:
            raise ValueError(f"window={window}; must be >= 1")
        if max_ratio is not None and not 0.0 < max_ratio <= 1.0:
            raise ValueError(f"max_ratio={max_ratio}; must be in (0, 1] or None")
        self.kind = kind
        self.max_consecutive = max_consecutive
        self.window = int(window)
        self.max_ratio = max_ratio
        self.max_consecutive_rejections = max_consecutive_rejections
        self._prefix = field_prefix
        self._lock = threading.Lock()
        # the last `window` outcomes: None = finished, else the failure's group key
        self._outcomes: deque[str | None] = deque(maxlen=max(self.window, max_consecutive or 1))
        self._examples: dict[str, str] = {}
        self._consecutive = 0
        # finished episodes in a row that gave nothing, by rejection reason
        self._empty_run: Counter[str] = Counter()
        self._finished = 0
        self._failed_total = 0
        self._failed_since_take = 0
        self._error: str | None = None

    # ------------------------------------------------------------------ recording
    def record_ok(self, rejected: str | None = None) -> None:
        """An episode finished: accepted (``rejected=None``) or legitimately rejected, with
        its reason (``"filtered"`` and ``"none"`` give nothing and count in a row)."""
        with self._lock:
            self._finished += 1
            self._consecutive = 0
            self._outcomes.append(None)
            if rejected is None:
                self._empty_run.clear()
            elif rejected in _GIVES_NOTHING:
                self._empty_run[rejected] += 1
                n = self.max_consecutive_rejections
                if self._error is None and n is not None and self._empty_run.total() >= n:
                    self._error = self._starved_message_locked(n)

    def record_failure(self, exc: BaseException | str) -> None:
        """An episode failed with ``exc`` (an exception or its description)."""
        desc = exc if isinstance(exc, str) else describe_failure(exc)
        key = _group_key(desc)
        with self._lock:
            self._finished += 1
            self._failed_total += 1
            self._failed_since_take += 1
            self._consecutive += 1
            self._outcomes.append(key)
            self._examples.setdefault(key, desc)
            if self._error is None:
                self._error = self._check_locked()

    # ------------------------------------------------------------------ reading
    @property
    def tripped(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> str | None:
        """Why the monitor tripped (the ``RolloutFailureError`` message), or None."""
        return self._error

    @property
    def failed_total(self) -> int:
        with self._lock:
            return self._failed_total

    def take_failed(self) -> int:
        """Failures recorded since the last call."""
        with self._lock:
            n, self._failed_since_take = self._failed_since_take, 0
            return n

    def raise_if_tripped(self) -> None:
        if self._error is not None:
            raise RolloutFailureError(self._error)

    def raise_if_all_failed(self) -> None:
        """Raise when every episode recorded so far failed (at least one): a finite set of
        episodes (an evaluation) that no rule could cover when it is shorter than them.
        Never when both rules are disabled (None)."""
        if self.max_consecutive is None and self.max_ratio is None:
            return
        with self._lock:
            if self._error is None and self._finished and self._failed_total == self._finished:
                n = self._finished
                self._error = self._message_locked(
                    f"all {n} {self.kind} episodes failed", list(self._outcomes)[-n:]
                )
        self.raise_if_tripped()

    # ------------------------------------------------------------------ internals
    def _check_locked(self) -> str | None:
        outcomes = list(self._outcomes)
        n = self.max_consecutive
        if n is not None and self._consecutive >= n:
            return self._message_locked(
                f"the last {n} {self.kind} episodes all failed "
                f"({self._prefix}max_consecutive_episode_failures={n})",
                outcomes[-n:],
            )
        if self.max_ratio is not None and self._finished >= self.window:
            last = outcomes[-self.window :]
            failed = sum(k is not None for k in last)
            if failed > self.max_ratio * self.window:
                return self._message_locked(
                    f"{failed} of the last {self.window} {self.kind} episodes failed, more "
                    f"than {self._prefix}max_episode_failure_ratio={self.max_ratio} "
                    f"({self._prefix}episode_failure_window={self.window})",
                    last,
                )
        return None

    def _starved_message_locked(self, n: int) -> str:
        why = {
            "filtered": "filtered out by the accept filter (should_accept_fn / AReaL's "
            "dynamic_filter_fn: with dynamic sampling, a group whose rewards are all equal)",
            "none": "returned None by the workflow",
        }
        parts = [f"{c} {why[k]}" for k, c in self._empty_run.most_common()]
        return (
            f"{self.kind} episodes give nothing: the last {n} finished episodes were all "
            f"rejected and none accepted ({self._prefix}max_consecutive_rejections={n}): "
            + "; ".join(parts)
            + ". The batch can never fill and the run would wait forever. If every group "
            "has the same reward, the task is too hard (or too easy) for the model: check "
            "the reward function on a few completions, an easier dataset, or turn the "
            "filter off; or raise the limit (null disables it)."
        )

    def _message_locked(self, rule: str, outcomes: list[str | None]) -> str:
        fails = Counter(k for k in outcomes if k is not None)
        key, count = fails.most_common(1)[0]
        return (
            f"{self.kind} episodes keep failing: {rule}. Most common failure: {count} of "
            f"these {len(outcomes)} episodes: {self._examples[key]} "
            f"({self._failed_total} of {self._finished} {self.kind} episodes failed in all). "
            "The run stops instead of resubmitting forever; fix the cause, or raise the "
            "limits (null disables them)."
        )
