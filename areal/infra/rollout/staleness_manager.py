"""Capacity control for asynchronous rollout: concurrency and staleness bounds.

The rollout side may run ahead of the trainer, but only so far. With ``B`` trajectories
consumed per training step and a maximum head off-policyness ``eta``, at most
``(eta + v + 1) * B`` rollouts may have been started (accepted + running) while the
weights are at version ``v``. Together with the concurrency limit this gives::

    capacity = min(max_concurrent_rollouts - running,
                   (max_staleness + version + 1) * consumer_batch_size - (accepted + running))

``max_staleness = 0`` is synchronous RL: a new batch of rollouts starts only once the
previous one has been consumed and the version bumped.

The bound assumes one version per consumed batch. A refused weight sync breaks that: the
trainer consumed its batch but the servers stay at the previous version ``v`` (the
``WeightSynchronizer`` rolls them back and the next step retries). ``on_sync_refused(v)``
records it: while the version is still ``v`` each refusal counts as one version in the
bound, so the batch the trainer needs for its next step (and its retry) can start, where
with ``max_staleness = 0`` nothing could (a deadlock). The credit ends with the first
version other than ``v``.

Counters (all behind one lock, safe to call from any thread):

* ``enqueued``: submitted by the user, waiting for capacity;
* ``running``: started, not finished;
* ``accepted``: finished and kept (cumulative over the run: it is what the staleness
  bound counts);
* ``rejected``: finished and dropped (workflow returned ``None``, raised, was filtered
  out by ``should_accept_fn``, or came back too stale).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutStat", "StalenessManager"]


@dataclass
class RolloutStat:
    """Snapshot of the rollout counters."""

    enqueued: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0


class StalenessManager:
    """Decides how many new rollouts may start now.

    Parameters
    ----------
    max_concurrent_rollouts:
        Upper bound on rollouts running at the same time (values < 1 are treated as 1).
    consumer_batch_size:
        Rollouts consumed per training step (values < 1 are treated as 1).
    max_staleness:
        Maximum head off-policyness ``eta`` (>= 0).
    version_provider:
        Optional source of the current weight version used when ``get_capacity`` is
        called without one: a zero-argument callable or an object with ``get_version()``
        (e.g. an ``InferenceEngine``).
    """

    def __init__(
        self,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_staleness: int,
        version_provider: Callable[[], int] | Any | None = None,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}; must be >= 0")
        self.max_concurrent_rollouts = max(1, int(max_concurrent_rollouts))
        self.consumer_batch_size = max(1, int(consumer_batch_size))
        self.max_staleness = int(max_staleness)
        self.version_provider = version_provider
        self.lock = threading.Lock()
        self.rollout_stat = RolloutStat()
        self._refused_at: int | None = None  # the version refused syncs left in place
        self._refusals = 0  # refused syncs while the version stayed _refused_at

    # ------------------------------------------------------------------ capacity
    def _current_version(self) -> int:
        provider = self.version_provider
        if provider is None:
            raise ValueError(
                "get_capacity() needs current_version when no version_provider was given"
            )
        if hasattr(provider, "get_version"):
            return int(provider.get_version())
        return int(provider())

    def get_pending_limit(self) -> int:
        """How many rollouts may be outstanding ahead of the trainer at one version."""
        return (self.max_staleness + 1) * self.consumer_batch_size

    def get_capacity(self, current_version: int | None = None) -> int:
        """Number of rollouts that may start now (negative when over the bound)."""
        if current_version is None:
            current_version = self._current_version()
        with self.lock:
            stat = self.rollout_stat
            concurrency_capacity = self.max_concurrent_rollouts - stat.running
            refused = self._refusals if self._refused_at == int(current_version) else 0
            staleness_capacity = (
                self.max_staleness + int(current_version) + refused + 1
            ) * self.consumer_batch_size - (stat.accepted + stat.running)
            return min(concurrency_capacity, staleness_capacity)

    # ------------------------------------------------------------------ events
    def on_sync_refused(self, version: int) -> None:
        """A weight sync was refused and the servers stay at ``version`` (module docstring)."""
        with self.lock:
            if self._refused_at != int(version):
                self._refused_at, self._refusals = int(version), 0
            self._refusals += 1

    def on_rollout_enqueued(self) -> None:
        with self.lock:
            self.rollout_stat.enqueued += 1

    def on_rollout_dequeued(self) -> None:
        """An enqueued rollout was dropped before it started (e.g. executor shutdown)."""
        with self.lock:
            self.rollout_stat.enqueued = max(0, self.rollout_stat.enqueued - 1)

    def on_rollout_submitted(self) -> None:
        """An enqueued rollout started running."""
        with self.lock:
            self.rollout_stat.enqueued = max(0, self.rollout_stat.enqueued - 1)
            self.rollout_stat.running += 1

    def on_rollout_accepted(self) -> None:
        with self.lock:
            self.rollout_stat.running -= 1
            self.rollout_stat.accepted += 1

    def on_rollout_rejected(self) -> None:
        with self.lock:
            self.rollout_stat.running -= 1
            self.rollout_stat.rejected += 1

    def on_rollout_discarded(self) -> None:
        """An accepted (not yet consumed) rollout was dropped, e.g. it became too stale.

        It no longer counts towards the staleness bound, so its slot is freed.
        """
        with self.lock:
            self.rollout_stat.accepted -= 1
            self.rollout_stat.rejected += 1

    def on_rejected_reclaimed(self, n: int = 1) -> None:
        """``n`` rejected (filtered) rollouts were handed out to fill a batch after all
        (``rollout.max_num_gen_batches``): they count as accepted, as consumed ones do."""
        if n <= 0:
            return
        with self.lock:
            self.rollout_stat.rejected -= n
            self.rollout_stat.accepted += n

    def on_version_recovered(self, version: int) -> None:
        """After resuming from a checkpoint at ``version``: accepted restarts at ``version * B``.

        Without this a resumed run would see ``accepted = 0`` and burst
        ``(eta + version + 1) * B`` rollouts at once.
        """
        if version < 0:
            raise ValueError(f"version={version}; must be >= 0")
        with self.lock:
            self.rollout_stat.accepted = int(version) * self.consumer_batch_size
            self._refused_at, self._refusals = None, 0

    def get_stats(self) -> RolloutStat:
        with self.lock:
            s = self.rollout_stat
            return RolloutStat(
                enqueued=s.enqueued, running=s.running, accepted=s.accepted, rejected=s.rejected
            )
