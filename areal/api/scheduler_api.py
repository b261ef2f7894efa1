"""Scheduler contract: who starts worker processes and how the controller talks to them.

A *job* is ``replicas`` copies of one role (``actor``, ``ref``, ``rollout``...). A
scheduler (local subprocesses, Ray, Slurm) turns a job into running *workers* and
returns their addresses. Two kinds of workers exist:

- RPC workers (``SchedulingSpec.cmd is None``): ``python -m areal.infra.rpc.rpc_server``
  hosting engine objects that the controller creates and calls over HTTP
  (``create_engine`` / ``call_engine``).
- Command workers (``SchedulingSpec.cmd`` set): any server command, e.g. an inference
  server, started with the same port assignment, logging, health check and teardown.

Names follow AReaL (``Worker``, ``Job``, ``SchedulingSpec``, ``SchedulingStrategy``,
``Scheduler.create_workers/get_workers/delete_workers/create_engine/call_engine``).
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any

# The resource/launch dataclasses live with the other configs (AReaL's layout); they are
# re-exported here because schedulers are their users.
from areal.api.cli_args import SchedulingSpec, SchedulingStrategy

__all__ = [
    "Job",
    "RemoteCallError",
    "Scheduler",
    "SchedulingSpec",
    "SchedulingStrategy",
    "Worker",
    "WorkerDiedError",
]


_RPC_SERVER_MODULE = "areal.infra.rpc.rpc_server"


def is_rpc_server_cmd(cmd: Any) -> bool:
    """True for ``[python|python3|<path>/python] -m areal.infra.rpc.rpc_server`` without a port."""
    if not cmd:
        return False
    import shlex

    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    return (
        len(argv) == 3
        and argv[0].rsplit("/", 1)[-1].startswith("python")
        and argv[1:] == ["-m", _RPC_SERVER_MODULE]
    )


@dataclass
class Job:
    """``replicas`` workers of one ``role``.

    ``tasks[0]`` describes each worker process (AReaL's form: a second entry describes the
    engine inside the worker; here only its ``env_vars`` are used, merged over the first).
    ``SchedulingSpec.cmd`` is ``None`` for an RPC worker, or a command string whose
    ``{port}`` / ``{port0}`` / ``{port1}`` ... / ``{host}`` placeholders are filled with the
    worker's ports; a leading ``python`` is replaced by the controller's interpreter.
    """

    replicas: int = 1
    tasks: list[SchedulingSpec] = field(default_factory=lambda: [SchedulingSpec(cpu=1, mem=4)])
    scheduling_strategy: SchedulingStrategy | None = None
    role: str = "worker"
    # HTTP path polled until it answers 200 (RPC workers always use /health).
    health_path: str = "/health"
    # RPC workers of a job get RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT when
    # True; None = True for RPC workers, False for command workers.
    distributed_env: bool | None = None

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"Job.replicas={self.replicas}; must be >= 1")
        if not self.role or "/" in self.role:
            raise ValueError(f"Job.role={self.role!r}; must be a non-empty name without '/'")
        if not self.tasks:
            raise ValueError("Job.tasks is empty; give at least one SchedulingSpec")

    @property
    def worker_spec(self) -> SchedulingSpec:
        """``tasks[0]``; AReaL's RPC-worker command (``python3 -m areal.infra.rpc.rpc_server``,
        to which the scheduler appends the port) reads as ``cmd=None``."""
        spec = self.tasks[0]
        if is_rpc_server_cmd(spec.cmd):
            import dataclasses

            return dataclasses.replace(spec, cmd=None)
        return spec

    @property
    def env_vars(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for t in self.tasks:
            env.update({str(k): str(v) for k, v in (t.env_vars or {}).items()})
        return env


@dataclass
class Worker:
    """A running worker: ``id`` is ``"{role}/{index}"``; ``worker_ports[0]`` serves HTTP."""

    id: str
    ip: str
    worker_ports: list[str] = field(default_factory=list)
    engine_ports: list[str] = field(default_factory=list)

    @property
    def serve_port(self) -> str:
        return self.worker_ports[0]

    @property
    def address(self) -> str:
        """``ip:port`` of the worker's HTTP endpoint."""
        return f"{self.ip}:{self.worker_ports[0]}"

    @property
    def role(self) -> str:
        return self.id.rsplit("/", 1)[0]

    @property
    def index(self) -> int:
        return int(self.id.rsplit("/", 1)[1])


class WorkerDiedError(RuntimeError):
    """A worker process exited; the message names it and quotes its log tail."""


class RemoteCallError(RuntimeError):
    """A method raised inside a worker; the message carries the remote traceback."""

    def __init__(
        self,
        message: str,
        worker_id: str = "",
        method: str = "",
        remote_type: str = "",
        remote_traceback: str = "",
    ):
        super().__init__(message)
        self.worker_id = worker_id
        self.method = method
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class Scheduler(abc.ABC):
    """Starts, finds, calls and stops workers."""

    @abc.abstractmethod
    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        """Start ``job.replicas`` workers, wait until healthy; return their ids.

        A scheduler may accept ``wait=False``: return once they are started, and wait in
        :meth:`wait_workers` (``LocalScheduler``); others wait here regardless."""

    def wait_workers(self, role: str) -> None:
        """Wait for workers started with ``create_workers(job, wait=False)`` to be healthy;
        raise what failed. Returns at once where ``create_workers`` already waited."""
        return None

    @abc.abstractmethod
    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        """Workers of ``role`` in index order (waits up to ``timeout`` s for them to exist)."""

    @abc.abstractmethod
    def delete_workers(self, role: str | None = None) -> None:
        """Stop the workers of ``role`` (all roles if None); stopping a dead worker is fine."""

    @abc.abstractmethod
    def create_engine(
        self, worker_id: str, engine: str, *args, engine_name: str = "default", **kwargs
    ) -> None:
        """Instantiate class ``engine`` (import path) in an RPC worker with ``*args, **kwargs``."""

    @abc.abstractmethod
    def call_engine(
        self,
        worker_id: str,
        method: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> Any:
        """Call ``engine.method(*args, **kwargs)`` in the worker; return its result."""

    async def async_call_engine(self, worker_id: str, method: str, *args, **kwargs) -> Any:
        """``call_engine`` on a thread, for asyncio callers."""
        return await asyncio.to_thread(self.call_engine, worker_id, method, *args, **kwargs)

    async def async_create_engine(self, worker_id: str, engine: str, *args, **kwargs) -> None:
        return await asyncio.to_thread(self.create_engine, worker_id, engine, *args, **kwargs)
