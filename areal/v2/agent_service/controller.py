"""``AgentController``: starts, scales and stops the agent service through a scheduler.

::

    from areal.api.cli_args import AgentConfig
    from areal.infra.scheduler.local import LocalScheduler
    from areal.v2.agent_service.controller import AgentController

    ctrl = AgentController(
        config=AgentConfig(agent_cls_path="pkg.module.MyAgent", admin_api_key="secret"),
        scheduler=LocalScheduler(experiment_name="agents", trial_name="t0"),
    )
    ctrl.initialize()          # the gateway, then one agent worker
    ctrl.gateway_addr          # http://127.0.0.1:PORT: POST /v1/responses there
    ctrl.scale_up(2)           # two more workers
    ctrl.scale_down(1)         # the newest one: no new turns, wait for its turns, stop it
    ctrl.destroy()

AReaL 2.0's controller forks a router, a gateway and a worker + data-proxy process per
pair onto guard processes. Here the scheduler starts the processes directly (scheduler
roles ``agent-gateway`` and ``agent-worker-<i>``), and the gateway process also plays
the router and the data proxies (:mod:`areal.v2.agent_service.gateway` says why), so a
"pair" is one worker process; ``router_addr`` is the gateway's address and each pair's
``proxy_addr`` too. The admin key reaches the processes through the environment.

A worker whose agent cannot be imported or built exits at start with the reason in its
log; ``initialize`` / ``scale_up`` then raise ``RuntimeError`` quoting it (and leave
nothing running on ``initialize``).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import threading
import time
from typing import Any

from areal.api.cli_args import AgentConfig
from areal.api.scheduler_api import Job
from areal.utils import logging
from areal.v2.agent_service.protocol import ADMIN_KEY_ENV

logger = logging.getLogger("AgentController")

GATEWAY_ROLE = "agent-gateway"
WORKER_ROLE = "agent-worker"


@dataclasses.dataclass(frozen=True)
class AgentPair:
    """One agent worker: its index, scheduler role and address."""

    pair_index: int
    role: str
    worker_addr: str
    proxy_addr: str  # the gateway (it holds the sessions' histories)


class AgentController:
    """The agent service's processes, started through ``scheduler`` (module docstring).

    ``scheduler``: a scheduler with command workers (``LocalScheduler``); None: a
    ``LocalScheduler`` owned (and closed) by this controller. ``num_pairs``: workers
    ``initialize`` starts (2.0 starts one). Timeouts in seconds: ``setup_timeout`` for
    the processes to answer ``/health``, ``drain_timeout`` for a scaled-down worker's
    turns to finish, ``request_timeout`` per turn, ``session_timeout`` before an idle
    session is dropped (default: ``config.session_timeout_seconds``).
    """

    def __init__(
        self,
        config: AgentConfig,
        scheduler: Any = None,
        *,
        num_pairs: int = 1,
        gateway_host: str = "127.0.0.1",
        gateway_port: int = 0,
        setup_timeout: float = 120.0,
        drain_timeout: float = 30.0,
        request_timeout: float = 600.0,
        session_timeout: float | None = None,
        health_interval: float = 5.0,
    ):
        if not config.agent_cls_path:
            raise ValueError("AgentConfig.agent_cls_path is empty; name the agent class")
        if num_pairs < 1:
            raise ValueError(f"num_pairs={num_pairs}; allowed: >= 1")
        self.config = config
        self._own_scheduler = scheduler is None
        if scheduler is None:
            from areal.infra.scheduler.local import LocalScheduler

            scheduler = LocalScheduler(experiment_name="agent-service", trial_name="run0")
        self.scheduler = scheduler
        self.num_pairs = num_pairs
        self.gateway_host = gateway_host
        self.gateway_port = gateway_port
        self.setup_timeout = setup_timeout
        self.drain_timeout = drain_timeout
        self.request_timeout = request_timeout
        self.session_timeout = float(session_timeout or config.session_timeout_seconds)
        self.health_interval = health_interval
        self._gateway_addr = ""
        self._pairs: dict[int, AgentPair] = {}
        self._next_index = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ properties
    @property
    def gateway_addr(self) -> str:
        """``http://host:port`` of the gateway ('' before ``initialize``)."""
        return self._gateway_addr

    @property
    def router_addr(self) -> str:
        """The gateway's address: it routes sessions itself."""
        return self._gateway_addr

    @property
    def pairs(self) -> dict[int, AgentPair]:
        with self._lock:
            return dict(self._pairs)

    # ------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Start the gateway and ``num_pairs`` workers; on failure stop what started."""
        try:
            self._start_gateway()
            self.scale_up(self.num_pairs)
        except BaseException:
            self.destroy()
            raise
        logger.info(
            "agent service up: gateway %s, %d worker(s) of %s",
            self._gateway_addr,
            len(self._pairs),
            self.config.agent_cls_path,
        )

    def destroy(self) -> None:
        """Stop every process this controller started (workers, then the gateway)."""
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in reversed(pairs):
            self._delete_role(pair.role)
        if self._gateway_addr:
            self._delete_role(GATEWAY_ROLE)
            self._gateway_addr = ""
        if self._own_scheduler:
            self.scheduler.delete_workers()

    def __enter__(self) -> AgentController:
        self.initialize()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    # ------------------------------------------------------------------ scaling
    def scale_up(self, count: int) -> list[int]:
        """Start ``count`` more workers and register them with the gateway; their indices.

        Raises ``RuntimeError`` (the failing worker's log quoted) when one does not come
        up; the workers of this call are stopped then."""
        if not self._gateway_addr:
            raise RuntimeError("AgentController.initialize() has not run")
        with self._lock:
            indices = list(range(self._next_index, self._next_index + count))
            self._next_index += count
        started: list[str] = []
        try:
            for i in indices:
                role = f"{WORKER_ROLE}-{i}"
                cmd = [
                    sys.executable, "-m", "areal.v2.agent_service.worker",
                    "--agent", self.config.agent_cls_path, "--host", "{host}", "--port", "{port}",
                ]  # fmt: skip
                self.scheduler.create_workers(self._job(role, cmd), wait=False)
                started.append(role)
            pairs = []
            for i, role in zip(indices, started):
                try:
                    (w,) = self.scheduler.get_workers(role)
                except Exception as e:
                    raise RuntimeError(
                        f"agent worker {i} ({self.config.agent_cls_path}) did not start: {e}"
                    ) from e
                addr = f"http://{w.ip}:{w.worker_ports[0]}"
                self._post("/register", {"addr": addr})
                pairs.append(AgentPair(i, role, addr, self._gateway_addr))
        except BaseException:
            for role in started:
                self._delete_role(role)
            raise
        with self._lock:
            self._pairs.update({p.pair_index: p for p in pairs})
        logger.info("agent workers up: %s", [p.worker_addr for p in pairs])
        return indices

    def scale_down(self, count: int) -> list[int]:
        """Stop the ``count`` newest workers, gracefully: the gateway routes no turn to
        them any more (their sessions continue elsewhere, history intact), their running
        turns finish (up to ``drain_timeout`` s), then they are stopped. Their indices."""
        with self._lock:
            victims = sorted(self._pairs.values(), key=lambda p: -p.pair_index)[:count]
        for pair in victims:
            self._post("/unregister", {"addr": pair.worker_addr})
            self._drain(pair)
            self._post("/unregister", {"addr": pair.worker_addr, "remove": True})
            self._delete_role(pair.role)
            with self._lock:
                self._pairs.pop(pair.pair_index, None)
            logger.info(
                "agent worker %d (%s) drained and stopped", pair.pair_index, pair.worker_addr
            )
        return [p.pair_index for p in victims]

    # ------------------------------------------------------------------ helpers
    def _job(self, role: str, cmd: list[str]) -> Job:
        base = self.config.scheduling_spec[0]
        env = {**(base.env_vars or {}), ADMIN_KEY_ENV: self.config.admin_api_key}
        spec = dataclasses.replace(base, cmd=shlex.join(cmd), port_count=1, env_vars=env)
        return Job(replicas=1, tasks=[spec], role=role, health_path="/health")

    def _start_gateway(self) -> None:
        port = str(self.gateway_port) if self.gateway_port else "{port}"
        cmd = [
            sys.executable, "-m", "areal.v2.agent_service.gateway",
            "--host", self.gateway_host, "--port", port,
            "--request-timeout", str(self.request_timeout),
            "--session-timeout", str(self.session_timeout),
            "--health-interval", str(self.health_interval),
        ]  # fmt: skip
        self.scheduler.create_workers(self._job(GATEWAY_ROLE, cmd))
        (w,) = self.scheduler.get_workers(GATEWAY_ROLE)
        host = "127.0.0.1" if self.gateway_host in ("0.0.0.0", "::") else self.gateway_host
        self._gateway_addr = f"http://{host}:{self.gateway_port or w.worker_ports[0]}"

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import requests

        r = requests.post(
            self._gateway_addr + path,
            json=body,
            headers={"Authorization": f"Bearer {self.config.admin_api_key}"},
            timeout=30,
        )
        if r.status_code != 200:
            raise RuntimeError(f"gateway {path} answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def _drain(self, pair: AgentPair) -> None:
        import requests

        deadline = time.monotonic() + self.drain_timeout
        headers = {"Authorization": f"Bearer {self.config.admin_api_key}"}
        while time.monotonic() < deadline:
            rows = requests.get(f"{self._gateway_addr}/workers", headers=headers, timeout=10)
            mine = [w for w in rows.json()["workers"] if w["addr"] == pair.worker_addr]
            if not mine or mine[0]["inflight"] == 0:
                return
            time.sleep(0.2)
        logger.warning(
            "agent worker %d still ran turns after %.0f s of draining; stopping it",
            pair.pair_index,
            self.drain_timeout,
        )

    def _delete_role(self, role: str) -> None:
        try:
            self.scheduler.delete_workers(role)
        except Exception as e:  # teardown goes on with the other roles
            logger.warning("stopping %s failed: %s", role, e)
