"""Counters of what the controller's RPC calls move: calls, bytes and transfer seconds.

Every ``RPCClient`` call of this process is recorded in :data:`RPC_TRAFFIC` under its
worker id (``"actor/0"``) and method: request and response body bytes, the call's wall
time and the worker's execution time (reported by the worker), so
``transfer seconds = wall - execution`` (pickling on both ends, HTTP on loopback,
unpickling). Read it with ``snapshot()`` / ``by_role()``; ``reset()`` starts afresh. The
transfer benchmark (``benchmarks/bench_batch_transfer.py``) and the tests of the
once-per-step batch path use it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class CallTraffic:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0
    exec_s: float = 0.0

    @property
    def transfer_s(self) -> float:
        return max(0.0, self.wall_s - self.exec_s)

    def add(self, other: CallTraffic) -> None:
        self.calls += other.calls
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.wall_s += other.wall_s
        self.exec_s += other.exec_s

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes": self.bytes_sent + self.bytes_received,
            "transfer_s": self.transfer_s,
            "wall_s": self.wall_s,
        }


class RPCTraffic:
    """Thread-safe totals keyed by ``(worker_id, method)``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], CallTraffic] = {}

    def record(
        self, worker_id: str, method: str, sent: int, received: int, wall_s: float, exec_s: float
    ) -> None:
        with self._lock:
            t = self._calls.setdefault((worker_id, method), CallTraffic())
            t.add(CallTraffic(1, sent, received, wall_s, exec_s))

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()

    def snapshot(self) -> dict[tuple[str, str], CallTraffic]:
        with self._lock:
            out = {}
            for key, t in self._calls.items():
                out[key] = CallTraffic()
                out[key].add(t)
            return out

    def by_role(self, method: str | None = None) -> dict[str, CallTraffic]:
        """Totals per role (the worker id before ``/``), optionally of one method only."""
        out: dict[str, CallTraffic] = {}
        for (worker, m), t in self.snapshot().items():
            if method is None or m == method:
                out.setdefault(worker.split("/", 1)[0], CallTraffic()).add(t)
        return out


#: This process's RPC traffic (every ``RPCClient``).
RPC_TRAFFIC = RPCTraffic()
