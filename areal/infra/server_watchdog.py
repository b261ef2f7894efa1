"""``ServerWatchdog``: restart dead inference servers with the current weights.

The trainer calls ``check()`` at points where the actor's weights equal the servers'
version (before ``prepare_batch`` and right after a weight update). For every server
process of role ``rollout`` that the scheduler reports dead it

1. logs a warning with the worker's exit code and log tail,
2. takes its address out of the ``RemoteInfEngine``'s rotation (its in-flight requests
   were already moved to the other servers by the engine's retry logic),
3. restarts it through the scheduler (``restart_worker``: same command, same port if
   possible, else a new address),
4. hands it to the ``WeightSynchronizer`` (``weight_sync.readmit``), which loads the
   *current* weights into it (version 0 = the initial model the command loads anyway;
   ``disk`` mode = the last weight-update directory; otherwise, or when that directory
   is gone, the actor writes its weights once per version to ``scratch_dir/v{v}``) and
   readmits it to the engine at the current version (paused if the rollout is paused).

``step_stats()`` returns ``rollout/server_restarts`` (restarts since the previous call),
``rollout/server_restart_seconds`` (time spent restarting since then; the restart blocks
the training loop until the server is healthy), ``rollout/server_restarts_total`` and
``rollout/servers_healthy``.

Schedulers without ``dead_workers``/``restart_worker`` (Ray, Slurm): servers the engine
marked unhealthy stay out of rotation (logged once each); training continues on the
others. A server that failed to restart ``max_restarts`` times is left out as well.
"""

from __future__ import annotations

import time
from typing import Any

from areal.api.io_struct import WeightUpdateMeta
from areal.infra.weight_sync import WeightSynchronizer
from areal.utils import logging

logger = logging.getLogger("ServerWatchdog")


class ServerWatchdog:
    """Detect dead inference servers, restart them and readmit them (module docstring)."""

    def __init__(
        self,
        scheduler: Any,
        rollout: Any,
        actor: Any = None,
        weight_update_meta: WeightUpdateMeta | None = None,
        scratch_dir: str | None = None,
        role: str = "rollout",
        max_restarts: int = 3,
        weight_sync: WeightSynchronizer | None = None,
    ):
        self.scheduler = scheduler
        self.rollout = rollout
        # Weights and version of a restarted server come from the one weight-sync object;
        # without one, a synchronizer over (actor, rollout, weight_update_meta) is made.
        self.weight_sync = weight_sync or WeightSynchronizer(
            actor, rollout, weight_update_meta, scratch_dir=scratch_dir
        )
        self.role = role
        self.max_restarts = max_restarts
        self.can_restart = callable(getattr(scheduler, "dead_workers", None)) and callable(
            getattr(scheduler, "restart_worker", None)
        )
        self.total_restarts = 0
        self._since_stats = 0
        self._seconds = 0.0
        self._failures: dict[str, int] = {}
        self._given_up: set[str] = set()
        self._reported_out: set[str] = set()
        self._addr: dict[str, str] = {}
        if self.can_restart:
            try:
                self._addr = {w.id: w.address for w in scheduler.get_workers(role)}
            except Exception as e:  # noqa: BLE001 - the watchdog must never stop training
                logger.warning(f"cannot list the {role!r} workers ({e}); restarts disabled")
                self.can_restart = False
        if not self.can_restart:
            logger.info(
                f"{type(scheduler).__name__} cannot restart inference servers: a server that "
                "dies stays out of rotation and training continues on the others"
            )

    # ------------------------------------------------------------------ checks
    def check(self) -> int:
        """Restart every dead server; returns how many were restarted and readmitted."""
        if not self.can_restart:
            self._report_out_of_rotation()
            return 0
        t0 = time.monotonic()
        try:
            return self._check()
        finally:
            self._seconds += time.monotonic() - t0

    def _check(self) -> int:
        try:
            dead = [w for w in self.scheduler.dead_workers(self.role) if w not in self._given_up]
        except Exception as e:  # noqa: BLE001
            logger.warning(f"dead_workers({self.role!r}) failed: {e}")
            return 0
        n = 0
        for wid in dead:
            if self._restart_one(wid):
                n += 1
        return n

    def _restart_one(self, wid: str) -> bool:
        old = self._addr.get(wid)
        info = ""
        exit_info = getattr(self.scheduler, "worker_exit_info", None)
        if callable(exit_info):
            try:
                info = "\n" + exit_info(wid)
            except Exception:  # noqa: BLE001
                info = ""
        logger.warning(f"inference server {wid} ({old}) died; restarting it{info}")
        if old is not None:
            self.rollout.exclude_server(old, "its process died")
        try:
            worker = self.scheduler.restart_worker(wid)
            path, version = self.weight_sync.readmit(worker.address, replaces=old)
        except Exception as e:  # noqa: BLE001 - a failed restart leaves the server out
            k = self._failures[wid] = self._failures.get(wid, 0) + 1
            if k >= self.max_restarts:
                self._given_up.add(wid)
            logger.error(
                f"restart of inference server {wid} failed ({k}/{self.max_restarts}): "
                f"{type(e).__name__}: {e}; training continues on "
                f"{self.rollout.healthy_addresses}"
                + ("; giving up on it" if wid in self._given_up else "; retrying next check")
            )
            return False
        self._addr[wid] = worker.address
        self.total_restarts += 1
        self._since_stats += 1
        logger.warning(
            f"inference server {wid} restarted at {worker.address} with weights version "
            f"{version} ({path or 'initial model'}); restarts so far: {self.total_restarts}"
        )
        return True

    def _report_out_of_rotation(self) -> None:
        addrs = getattr(self.rollout, "addresses", [])
        healthy = set(getattr(self.rollout, "healthy_addresses", addrs))
        for a in addrs:
            if a not in healthy and a not in self._reported_out:
                self._reported_out.add(a)
                logger.warning(
                    f"inference server {a} is out of rotation and {type(self.scheduler).__name__} "
                    f"cannot restart it; training continues on {sorted(healthy)}"
                )

    # ------------------------------------------------------------------ stats
    def step_stats(self) -> dict[str, float]:
        """Restarts (and seconds spent on them) since the previous call, the total, and the
        number of healthy servers."""
        n, self._since_stats = self._since_stats, 0
        seconds, self._seconds = self._seconds, 0.0
        return {
            "rollout/server_restarts": float(n),
            "rollout/server_restart_seconds": seconds,
            "rollout/server_restarts_total": float(self.total_restarts),
            "rollout/servers_healthy": float(len(self.rollout.healthy_addresses)),
        }
