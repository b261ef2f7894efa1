"""Health and rotation of ``RemoteInfEngine``'s servers.

- ``_wait_healthy``: block until servers answer their health endpoint (start-up, readmission);
- ``_choose_server``: the rid's server if it has one, else the healthy server with the
  fewest requests in flight;
- ``_health_loop`` (a background thread): probes every server every
  ``health_check_interval`` s; a server that answers neither a probe nor a request for
  ``health_check_timeout`` s is declared *hung* (``hung_addresses``) and leaves the rotation;
- ``_mark_unhealthy`` / ``exclude_server``: take a server out of rotation (its requests
  move); ``readmit_server``: bring a restarted server back with the current weights.
"""

from __future__ import annotations

import concurrent.futures
import time

from areal.api.inference_protocol import NoHealthyServerError
from areal.infra.wait_log import WaitLog
from areal.utils import logging

logger = logging.getLogger("RemoteInfEngine")


class ServerRotationMixin:
    """Which servers take requests (module docstring).

    Uses the engine's ``config``, ``backend``, ``addresses``, ``_healthy``, ``_inflight``,
    ``_rid_server``, ``_lock``, ``_last_ok``, ``_hung``, ``_health_stop``, ``_paused``,
    ``_version``, ``_initialized`` and ``_post`` (``areal.inference.remote.http``).
    """

    def _wait_healthy(self, addrs: list[str], timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        wait_log = WaitLog(logger)
        for a in addrs:
            last = "no answer yet"
            while True:
                try:
                    r = requests.get(f"http://{a}{self.backend.health_path}", timeout=5)
                    if r.status_code == 200:
                        break
                    last = f"HTTP {r.status_code}"
                except requests.RequestException as e:
                    last = type(e).__name__
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"inference server {a} not healthy after {timeout:.0f} s (last: {last})"
                    )
                wait_log.tick(
                    lambda a=a, last=last: (
                        f"inference server {a} to become healthy ({last}; gives up in "
                        f"{deadline - time.monotonic():.0f} s; servers {addrs})"
                    )
                )
                time.sleep(0.5)

    @property
    def healthy_addresses(self) -> list[str]:
        with self._lock:
            return [a for a in self.addresses if self._healthy.get(a)]

    @property
    def hung_addresses(self) -> list[str]:
        """Servers taken out of rotation because they missed the health deadline (alive
        but silent); the ``ServerWatchdog`` kills and restarts them."""
        with self._lock:
            return [a for a in self.addresses if a in self._hung and not self._healthy.get(a)]

    def _is_healthy(self, addr: str) -> bool:
        with self._lock:
            return bool(self._healthy.get(addr))

    def inflight_summary(self) -> str:
        """Requests in flight per server and which servers are out (for wait log lines)."""
        with self._lock:
            per = {a: self._inflight.get(a, 0) for a in self.addresses}
            rids: dict[str, list[str]] = {}
            for r, a in self._rid_server.items():
                rids.setdefault(a, []).append(r)
            out = [a for a in self.addresses if not self._healthy.get(a)]
        parts = [
            f"{a}: {n} in flight" + (f" (rids {sorted(rids[a])[:4]}...)" if rids.get(a) else "")
            for a, n in per.items()
        ]
        return "; ".join(parts) + (f"; out of rotation: {out}" if out else "")

    # ------------------------------------------------------------------ health deadlines
    def _health_loop(self, interval: float) -> None:
        import requests

        deadline_s = float(self.config.health_check_timeout)
        probe_timeout = max(1.0, min(deadline_s, interval * 2, 10.0))
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="health")

        def probe(a: str) -> bool:
            try:
                r = requests.get(f"http://{a}{self.backend.health_path}", timeout=probe_timeout)
                if r.status_code == 200:
                    with self._lock:
                        self._last_ok[a] = time.monotonic()
                    return True
            except requests.RequestException:
                pass
            return False

        try:
            while not self._health_stop.wait(interval):
                addrs = self.healthy_addresses
                futs = {a: pool.submit(probe, a) for a in addrs}
                concurrent.futures.wait(futs.values(), timeout=probe_timeout + 1)
                now = time.monotonic()
                for a in addrs:
                    f = futs[a]
                    if f.done() and not f.exception() and f.result():
                        # answered this round: never hung, however long the slowest probe
                        # (a server behind a cut link) kept this round waiting
                        continue
                    with self._lock:
                        silent = now - self._last_ok.get(a, now)
                    if silent > deadline_s and self._is_healthy(a):
                        with self._lock:
                            self._hung.add(a)
                            n = self._inflight.get(a, 0)
                        self._mark_unhealthy(
                            a,
                            f"hung: no answer to health probes or requests for {silent:.0f} s "
                            f"(health_check_timeout={deadline_s:g}); its {n} in-flight "
                            "request(s) move to the other servers",
                        )
        except Exception as e:  # noqa: BLE001 - never let the monitor die silently
            logger.error("health monitor stopped: %s: %s", type(e).__name__, e)
        finally:
            pool.shutdown(wait=False)

    def _choose_server(self, rid: str) -> str:
        with self._lock:
            a = self._rid_server.get(rid)
            if a is not None and self._healthy.get(a):
                return a
            healthy = [x for x in self.addresses if self._healthy.get(x)]
            if not healthy:
                raise NoHealthyServerError(
                    f"no healthy inference server left (all of {self.addresses} stopped answering)"
                )
            a = min(healthy, key=lambda x: self._inflight[x])
            self._rid_server[rid] = a
            return a

    def _mark_unhealthy(self, addr: str, why: str) -> None:
        with self._lock:
            was = self._healthy.get(addr)
            self._healthy[addr] = False
            for rid in [r for r, a in self._rid_server.items() if a == addr]:
                del self._rid_server[rid]
        if was:
            logger.warning("inference server %s marked unhealthy: %s", addr, why)

    def exclude_server(self, addr: str, why: str = "excluded") -> None:
        """Take ``addr`` out of rotation (as if it had stopped answering); its requests move."""
        self._mark_unhealthy(addr, why)

    def readmit_server(
        self,
        addr: str,
        weights_path: str | None = None,
        version: int | None = None,
        replaces: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """Bring a (restarted) server back into rotation with the current weights.

        Waits until ``addr`` is healthy; when ``weights_path`` is given the server reloads
        its weights from that Hugging Face directory; then it gets ``version`` (default:
        the engine's current version), is paused if the engine is paused, and is marked
        healthy. ``replaces``: the old address of a server that came back on a new port;
        it is taken out of ``addresses`` and ``addr`` takes its place. Blocking (call it
        from the controller thread, not from an event loop).

        ``xccl`` weight updates: a readmitted server is not a member of the weight-update
        process group formed at start-up; the caller must re-form the group.
        """
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad server address {addr!r}; expected 'host:port'")
        if not self._initialized:
            raise RuntimeError("RemoteInfEngine.initialize() was not called")
        timeout = self.config.setup_timeout if timeout is None else timeout
        if addr in self.addresses:  # no requests to it until it has the current weights
            self._mark_unhealthy(addr, "being readmitted")
        self._wait_healthy([addr], timeout)
        version = self._version if version is None else int(version)
        t0 = time.monotonic()
        if weights_path is not None:
            self._post(
                addr,
                self.backend.update_disk_call(weights_path, version),
                timeout=max(timeout, self.config.request_timeout),
            )
        call = self.backend.set_version_call(version)
        if call is not None:
            self._post(addr, call)
        if self._paused.is_set():
            self._post(addr, self.backend.pause_call())
        with self._lock:
            if replaces is not None and replaces != addr and replaces in self.addresses:
                self.addresses[self.addresses.index(replaces)] = addr
                self._healthy.pop(replaces, None)
                for rid in [r for r, a in self._rid_server.items() if a == replaces]:
                    del self._rid_server[rid]
            elif addr not in self.addresses:
                self.addresses.append(addr)
            if replaces is not None:
                self._hung.discard(replaces)
                self._last_ok.pop(replaces, None)
            self._hung.discard(addr)
            self._last_ok[addr] = time.monotonic()
            self._inflight.setdefault(addr, 0)
            self._healthy[addr] = True
        logger.info(
            "inference server %s readmitted at version %d%s in %.2fs",
            addr,
            version,
            f" with weights {weights_path}" if weights_path else "",
            time.monotonic() - t0,
        )
