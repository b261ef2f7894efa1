"""The gateway's routing state: proxy workers, session routes, counters (no I/O).

A session is identified as the proxy identifies it: by the ``session_id`` and the
session ``api_key`` that ``/rl/start_session`` returns. The router remembers, for each
session, the proxy worker that holds it; every later call presenting the session's key
(``/chat/completions``, ``/rl/set_reward``, ...) or naming its ``session_id``
(``/export_trajectories``) goes to that worker. Online-mode grants are remembered the
same way (``slot_id`` -> worker).

New sessions go to the least-loaded live worker (fewest open sessions, then fewest
requests in flight, then fewest sessions so far); a worker holding open online grants is
preferred, since only there can an external session start. ``mark_dead`` takes a worker out of rotation and fails
its sessions not yet exported with a reason (later calls of those sessions are answered with it);
``revive`` puts a worker that answers its health check again back (new sessions only:
the sessions it held are gone with its process).

Everything here runs on the gateway's event loop: no locks (the ``KeyRing`` has its own).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from areal.utils import auth, logging

logger = logging.getLogger("GatewayRouter")

#: Ended or failed sessions whose routes are kept (for export / clear errors).
MAX_CLOSED_ROUTES = 65536


@dataclass
class ProxyWorker:
    """One proxy worker behind the gateway."""

    url: str
    alive: bool = True
    open_sessions: int = 0
    #: sessions whose ``/rl/start_session`` is on its way to the worker: they count as
    #: open while choosing, or concurrent starts would all pile onto one worker
    starting: int = 0
    inflight: int = 0
    sessions_total: int = 0
    open_grants: int = 0
    health_failures: int = 0
    reason: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "alive": self.alive,
            "open_sessions": self.open_sessions,
            "starting": self.starting,
            "inflight": self.inflight,
            "sessions_total": self.sessions_total,
            "open_grants": self.open_grants,
            "reason": self.reason,
        }


@dataclass
class Route:
    """Where one session lives, and whether it ended or failed."""

    session_id: str
    worker: ProxyWorker
    api_key: str
    ended: bool = False
    failed: str = ""  # the reason, once the session is lost


@dataclass
class GatewayStats:
    sessions_started: int = 0
    sessions_ended: int = 0
    sessions_exported: int = 0
    sessions_failed: int = 0
    requests: int = 0
    requests_failed: int = 0
    failure_reasons: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "sessions_started": self.sessions_started,
            "sessions_ended": self.sessions_ended,
            "sessions_exported": self.sessions_exported,
            "sessions_failed": self.sessions_failed,
            "requests": self.requests,
            "requests_failed": self.requests_failed,
            "failure_reasons": dict(self.failure_reasons),
        }


class NoLiveWorker(RuntimeError):
    """Every proxy worker is dead."""


class Router:
    """Session-affine routing over ``worker_urls`` (module docstring)."""

    def __init__(self, worker_urls: list[str], admin_key: str):
        if not worker_urls:
            raise ValueError("the gateway needs at least one proxy worker URL")
        self.workers = [ProxyWorker(url.rstrip("/")) for url in worker_urls]
        self.keys = auth.KeyRing(admin_key)
        self.routes: OrderedDict[str, Route] = OrderedDict()  # session_id -> route
        self.slots: dict[str, ProxyWorker] = {}  # online grant -> worker
        self.stats = GatewayStats()

    # ------------------------------------------------------------------ choosing
    def pick(self) -> ProxyWorker:
        """The worker a new session goes to (module docstring)."""
        live = [w for w in self.workers if w.alive]
        if not live:
            reasons = "; ".join(f"{w.url}: {w.reason}" for w in self.workers)
            raise NoLiveWorker(f"no live proxy worker behind the gateway ({reasons})")
        granted = [w for w in live if w.open_grants > 0]
        # ties (e.g. sessions that start after the previous one ended) rotate by total
        return min(
            granted or live,
            key=lambda w: (w.open_sessions + w.starting, w.inflight, w.sessions_total),
        )

    def route_of_key(self, key: str | None) -> Route | None:
        sid = self.keys.session_of(key)
        return None if sid is None else self.routes.get(sid)

    # ------------------------------------------------------------------ session events
    def bind(self, session_id: str, api_key: str, worker: ProxyWorker) -> Route:
        """A session started on ``worker`` (its key now routes there)."""
        previous = self.route_of_key(api_key)
        if previous is not None:  # session refresh: the old session ended on the worker
            self.keys.revoke_session(previous.session_id)
            self._close(previous)
        route = Route(session_id, worker, api_key)
        self.routes[session_id] = route
        self.keys.issue(session_id, api_key)
        worker.open_sessions += 1
        worker.sessions_total += 1
        if worker.open_grants > 0:
            worker.open_grants -= 1
        self.stats.sessions_started += 1
        return route

    def ended(self, route: Route) -> None:
        """``/rl/end_session`` succeeded: the key is revoked, the route kept for export."""
        self.keys.revoke_session(route.session_id)
        self._close(route)

    def exported(self, session_id: str) -> None:
        route = self.routes.pop(session_id, None)
        if route is not None:
            self._close(route)
            self.stats.sessions_exported += 1

    def _close(self, route: Route) -> None:
        if not route.ended and not route.failed:
            route.ended = True
            route.worker.open_sessions -= 1
            self.stats.sessions_ended += 1
        self._trim()

    def _trim(self) -> None:
        if len(self.routes) <= MAX_CLOSED_ROUTES:
            return
        closed = [sid for sid, r in self.routes.items() if r.ended or r.failed]
        for sid in closed[: max(0, len(closed) - MAX_CLOSED_ROUTES)]:
            self.keys.revoke_session(sid)
            del self.routes[sid]

    # ------------------------------------------------------------------ failures
    def record_failure(self, reason: str) -> None:
        self.stats.requests_failed += 1
        self.stats.failure_reasons[reason] += 1

    def mark_dead(self, worker: ProxyWorker, reason: str) -> int:
        """Take ``worker`` out of rotation; fail its sessions not yet exported (open ones and
        ended ones whose export is still to come: their data died with the worker).
        Returns how many."""
        if not worker.alive:
            return 0
        worker.alive = False
        worker.reason = reason
        worker.open_grants = 0
        failed = 0
        for route in self.routes.values():  # open, or ended but not yet exported
            if route.worker is worker and not route.failed:
                route.failed = reason
                failed += 1
        worker.open_sessions = 0
        for slot, w in list(self.slots.items()):
            if w is worker:
                del self.slots[slot]
        self.stats.sessions_failed += failed
        logger.error(
            f"proxy worker {worker.url} is out of rotation ({reason}); {failed} open session(s) failed"
        )
        self._trim()
        return failed

    def revive(self, worker: ProxyWorker) -> None:
        if not worker.alive:
            logger.info(f"proxy worker {worker.url} answers again; back in rotation")
            worker.alive = True
            worker.reason = ""
        worker.health_failures = 0

    def describe(self) -> dict[str, Any]:
        return {
            **self.stats.as_dict(),
            "open_sessions": sum(w.open_sessions for w in self.workers),
            "workers": [w.describe() for w in self.workers],
        }
