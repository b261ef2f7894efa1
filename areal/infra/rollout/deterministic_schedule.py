"""The rollout schedule of a ``deterministic: true`` run: which rows, when, at which version.

An asynchronous run is reproducible only if nothing that shapes a batch depends on timing.
This module is the timing-free plan that ``WorkflowExecutor`` follows in that mode (pure
bookkeeping, no threads, no I/O):

- training rows are generated in *waves*: wave ``k`` produces exactly batch ``k`` of the
  trainer (``batch_size`` accepted groups);
- wave ``k`` is served by weights of version ``pinned_version(k) = max(0, k - eta)``
  (``max(v, k - eta)`` after a resume at version ``v``: ``rebase``)
  (``eta`` = ``max_head_offpolicyness``): it opens only while that version is live, and the
  trainer does not push version ``v + 1`` before every wave pinned to ``v`` is complete
  (``last_wave_pinned_to(v)``), so no request of it ever sees other weights;
- waves run one after the other, each in *rounds*: the first round submits ``batch_size``
  new rows; once all of a round finished, the next one resubmits the rows to retry (no
  server) and draws as many new rows as groups are still missing (filtered or failed
  groups), so the rows a wave draws depend on the results, never on their arrival order;
  with ``dynamic_bs`` a wave ends after its first round that accepted a group;
- a wave's batch is its accepted results in submission (task id) order.

Rows get a *data index* (their position in the order they were drawn, which a seeded
dataloader fixes) from the executor; workflows derive their sampling seeds from it
(``workflow_context.seed_key``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeterministicSchedule", "Round", "ScheduleError", "Wave"]


class ScheduleError(RuntimeError):
    """The weights moved past a wave's pinned version before the wave was complete."""


@dataclass
class Round:
    """What to submit now: ``retry`` rows (``(data_index, row)``) then ``n_new`` new rows,
    all for wave ``wave``."""

    wave: int
    retry: list[tuple[int, Any]]
    n_new: int


@dataclass
class Wave:
    index: int
    version: int
    tasks: list[int] = field(default_factory=list)
    outstanding: set[int] = field(default_factory=set)
    accepted: dict[int, Any] = field(default_factory=dict)
    retry: list[tuple[int, Any]] = field(default_factory=list)
    rounds: int = 0
    complete: bool = False


class DeterministicSchedule:
    """Waves, rounds and pinned versions (see the module docstring)."""

    def __init__(self, batch_size: int, max_head_offpolicyness: int, dynamic_bs: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; must be >= 1")
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness={max_head_offpolicyness}; must be >= 0")
        self.batch_size = int(batch_size)
        self.eta = int(max_head_offpolicyness)
        self.dynamic_bs = bool(dynamic_bs)
        self.waves: dict[int, Wave] = {}
        self._task_wave: dict[int, int] = {}
        self.next_wave = 0  # the next wave to open
        self.next_batch = 0  # the next wave to hand out
        self.base = 0  # the version the run started (or resumed) at

    def pinned_version(self, k: int) -> int:
        """The weight version that serves every request of wave ``k``."""
        return max(self.base, int(k) - self.eta)

    def rebase(self, version: int) -> None:
        """A run resumed at ``version``: the next batch is wave ``version``, and waves
        ``version .. version + eta`` are served by ``version`` (as at a start)."""
        if self.waves:
            raise ValueError("rebase: the schedule has open waves")
        self.base = self.next_wave = self.next_batch = int(version)

    def last_wave_pinned_to(self, version: int) -> int:
        """The last wave served by ``version``: all waves up to it must be complete before
        version ``version + 1`` is pushed."""
        return int(version) + self.eta

    # ------------------------------------------------------------------ planning
    def next_round(self, version: int) -> Round | None:
        """The round to submit now at weight version ``version``, or None (wait)."""
        cur = self.waves.get(self.next_wave - 1)
        if cur is not None and not cur.complete:
            if version != cur.version:
                raise ScheduleError(
                    f"deterministic rollout: wave {cur.index} is pinned to weight version "
                    f"{cur.version} but the weights are at version {version} before it "
                    "completed (weights were updated without waiting for the pinned waves)"
                )
            if cur.outstanding:
                return None
            missing = self.batch_size - len(cur.accepted)
            done = missing <= 0 or (self.dynamic_bs and cur.accepted and not cur.retry)
            if not done:
                retry, cur.retry = cur.retry, []
                cur.rounds += 1
                return Round(cur.index, retry, max(0, missing - len(retry)))
            cur.complete = True
        k = self.next_wave
        if self.pinned_version(k) != version:
            if self.pinned_version(k) < version:
                raise ScheduleError(
                    f"deterministic rollout: wave {k} is pinned to weight version "
                    f"{self.pinned_version(k)} but the weights are already at version {version}"
                )
            return None
        self.waves[k] = Wave(index=k, version=version, rounds=1)
        self.next_wave += 1
        return Round(k, [], self.batch_size)

    # ------------------------------------------------------------------ events
    def on_submitted(self, wave: int, task_id: int) -> None:
        w = self.waves[wave]
        w.tasks.append(int(task_id))
        w.outstanding.add(int(task_id))
        self._task_wave[int(task_id)] = wave

    def owns(self, task_id: int) -> bool:
        return int(task_id) in self._task_wave

    def on_finished(
        self, task_id: int, result: Any = None, retry_row: tuple[int, Any] | None = None
    ) -> None:
        """Task ``task_id`` ended: accepted with ``result`` (not None), rejected (None), or
        to be run again in the next round (``retry_row`` = its ``(data_index, row)``)."""
        w = self.waves[self._task_wave.pop(int(task_id))]
        w.outstanding.discard(int(task_id))
        if result is not None:
            w.accepted[int(task_id)] = result
        elif retry_row is not None:
            w.retry.append(retry_row)

    # ------------------------------------------------------------------ consumption
    def is_complete(self, k: int) -> bool:
        """Wave ``k`` has all its groups; a call may close it (``next_round`` logic)."""
        w = self.waves.get(k)
        return w is not None and w.complete

    def take(self, k: int) -> list[Any]:
        """The accepted results of complete wave ``k`` in submission order (removed)."""
        w = self.waves.get(k)
        if w is None or not w.complete:
            raise ValueError(f"wave {k} is not complete")
        del self.waves[k]
        self.next_batch = max(self.next_batch, k + 1)
        return [w.accepted[t] for t in sorted(w.accepted)]

    def pending_rows(self) -> list[tuple[int, Any]]:
        """Retry rows not yet resubmitted (for a recover checkpoint)."""
        return [r for w in self.waves.values() for r in w.retry]
