"""``LocalScheduler``: workers as subprocesses of the controller on this machine.

Each worker is its own process group (``start_new_session``), logs stdout+stderr to
``{fileroot}/logs/{experiment}/{trial}/{role}-{i}.log``, gets ``port_count`` free ports
(``worker_ports[0]`` serves HTTP) and must answer ``GET {job.health_path}`` with 200 within
``startup_timeout`` seconds (``create_workers(job, wait=False)`` returns once the processes
are started; ``wait_workers(role)``, or ``get_workers``, waits for that). Worker addresses
are published with ``name_resolve`` under ``{experiment}/{trial}/workers/{role}/{i}``
(root: ``cluster.name_resolve.nfs_record_root`` of ``exp_config``, else
``{fileroot}/name_resolve``).

RPC workers (``SchedulingSpec.cmd is None``) of a job also get ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` (= rank on CPU, 0 when a GPU is assigned through
``CUDA_VISIBLE_DEVICES``), ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (rank 0's
``worker_ports[1]``, shared), plus ``OMP_NUM_THREADS=1`` for every worker.

No orphans: ``delete_workers`` sends SIGTERM to each process group, then SIGKILL after
``kill_grace`` seconds (and kills any descendant that left the group); it also runs at
interpreter exit (``atexit``) and on SIGTERM of the controller (turned into
``SystemExit`` when no other handler is installed). Workers started from the main thread
get ``PR_SET_PDEATHSIG=SIGKILL`` on Linux, and RPC workers also poll their parent, so a
``kill -9`` of the controller does not leave them behind.

Dead workers: a monitor thread logs any worker that exits unexpectedly, and
``call_engine`` on a dead worker (or one that dies during the call) raises
``WorkerDiedError`` naming role, index, pid and exit code with the last lines of its log.
``dead_workers(role)`` lists the workers of a role that exited on their own, and
``restart_worker(worker_id)`` starts a dead *command* worker (e.g. an inference server)
again in place: same command, environment and (appended) log file, the same port when
it can be bound again, else a new one (the returned ``Worker`` has the new address).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

import psutil

from areal.api.scheduler_api import Job, SchedulingSpec, Worker, WorkerDiedError
from areal.infra.rpc.client import RPCClient
from areal.infra.scheduler.base import (
    LOG_TAIL_LINES,
    SchedulerBase,
    format_command,
    log_tail_block,
    read_log_tail,
    set_pdeathsig,
    worker_base_env,
)
from areal.utils import logging
from areal.utils.auth import ensure_run_secret
from areal.utils.name_resolve import FileNameRecordRepository, make_repository
from areal.utils.network import find_free_ports

if TYPE_CHECKING:
    from areal.api.experiment_config import BaseExperimentConfig

logger = logging.getLogger("LocalScheduler")

__all__ = ["LOG_TAIL_LINES", "LocalScheduler", "read_log_tail"]


def _can_bind(ports: list[int], host: str = "127.0.0.1") -> bool:
    """Whether every port in ``ports`` can be bound (as servers do, with SO_REUSEADDR)."""
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


_PORT_TAKEN = ("errno 98", "address already in use")


def _lost_port_race(log_path: str) -> bool:
    """Whether the worker's last start (the log after its last ``=====`` line) failed to
    bind a port that another process took (``EADDRINUSE``)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    last_start = text.rfind("\n===== ")
    text = (text[last_start:] if last_start >= 0 else text).lower()
    return any(s in text for s in _PORT_TAKEN)


@dataclass
class _PendingStart:
    """A role started with ``create_workers(job, wait=False)``, not yet waited for."""

    job: Job
    procs: list
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
    error: BaseException | None = None


@dataclass
class _WorkerProc:
    worker: Worker
    role: str
    index: int
    proc: subprocess.Popen
    log_path: str
    log_file: IO
    cmd: list[str]
    client: RPCClient | None
    stopping: bool = False
    reported: bool = False
    descendants: list[int] = field(default_factory=list)
    # What ``restart_worker`` needs to start the same worker again.
    spec: SchedulingSpec | None = None
    env: dict[str, str] | None = None
    health_path: str = "/health"
    restarts: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def dead_error(self, during: str = "") -> WorkerDiedError:
        code = self.proc.poll()
        what = f" during {during}" if during else ""
        return WorkerDiedError(
            f"Worker {self.worker.id} (role={self.role}, index={self.index}, pid={self.pid}) "
            f"is dead{what}: exit code {code}. Command: {shlex.join(self.cmd)}\n"
            f"{log_tail_block(self.log_path)}"
        )


class LocalScheduler(SchedulerBase):
    """Subprocess scheduler (see module docstring).

    ``exp_config`` (a ``BaseExperimentConfig``-like object) supplies defaults for
    ``fileroot`` (``cluster.fileroot``), ``experiment_name`` and ``trial_name``.
    ``call_timeout`` bounds every ``call_engine`` (None = unbounded while the worker lives).
    """

    def __init__(
        self,
        fileroot: str | None = None,
        experiment_name: str | None = None,
        trial_name: str | None = None,
        *,
        exp_config: BaseExperimentConfig | None = None,
        startup_timeout: float = 180.0,
        kill_grace: float = 5.0,
        call_timeout: float | None = None,
        monitor_interval: float = 1.0,
        gpu_devices: list[int] | None = None,
        host: str = "127.0.0.1",
    ):
        # the per-run secret every worker/server we start inherits (environment only)
        ensure_run_secret()
        self._init_base(exp_config, fileroot, experiment_name, trial_name)
        self.startup_timeout = startup_timeout
        self.kill_grace = kill_grace
        self.call_timeout = call_timeout
        self.host = host
        self.gpu_devices = gpu_devices
        self._next_gpu = 0
        nr = exp_config.cluster.name_resolve if exp_config is not None else None
        if nr is not None and nr.type == "etcd3":
            self.name_resolve = make_repository(nr)
        else:
            self.name_resolve = FileNameRecordRepository(
                (nr.nfs_record_root if nr is not None else None)
                or os.path.join(self.fileroot, "name_resolve")
            )
        self._used_ports: set[int] = set()
        self._starting: dict[str, _PendingStart] = {}  # create_workers(wait=False), not waited
        self._stop_monitor = threading.Event()
        self._monitor = threading.Thread(
            target=self._monitor_loop,
            args=(weakref.ref(self), monitor_interval, self._stop_monitor),
            daemon=True,
            name="local-scheduler-monitor",
        )
        self._monitor.start()
        self._install_sigterm_handler()

    # ------------------------------------------------------------------ lifecycle
    connection_grace = 2.0  # a dropped RPC connection: time for the worker's exit to show

    def close(self) -> None:
        """Stop every worker and the monitor."""
        super().close()
        self._stop_monitor.set()

    @staticmethod
    def _install_sigterm_handler() -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

            def _raise_exit(signum, _frame):
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, _raise_exit)

    @staticmethod
    def _monitor_loop(ref: weakref.ref, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            sched = ref()
            if sched is None:
                return
            with sched._lock:
                procs = [p for ps in sched._roles.values() for p in ps]
            for p in procs:
                if not p.stopping and not p.reported and p.proc.poll() is not None:
                    p.reported = True
                    logger.error(str(p.dead_error()))
            del sched

    # ------------------------------------------------------------------ workers
    def _allocate_ports(self, n: int) -> list[int]:
        with self._lock:
            ports = find_free_ports(n, exclude=self._used_ports, host=self.host)
            self._used_ports.update(ports)
            return ports

    def _gpus_for(self, spec: SchedulingSpec) -> list[int]:
        if spec.gpu <= 0:
            return []
        if self.gpu_devices is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                self.gpu_devices = [int(x) for x in visible.split(",") if x.strip()]
            else:
                import torch

                self.gpu_devices = list(range(torch.cuda.device_count()))
        if len(self.gpu_devices) < spec.gpu:
            raise RuntimeError(
                f"A worker asks for {spec.gpu} GPU(s); this machine has {self.gpu_devices}"
            )
        out = []
        for _ in range(spec.gpu):
            out.append(self.gpu_devices[self._next_gpu % len(self.gpu_devices)])
            self._next_gpu += 1
        return out

    def _command(self, spec: SchedulingSpec, ports: list[int]) -> list[str]:
        if spec.cmd is None:
            return [
                sys.executable, "-m", "areal.infra.rpc.rpc_server",
                "--port", str(ports[0]), "--host", self.host, "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
        return format_command(spec.cmd, self.host, ports)

    def create_workers(self, job: Job, *args, wait: bool = True, **kwargs) -> list[str]:
        """Start the workers of ``job`` and wait until all are healthy; returns their ids.

        ``wait=False``: return once the processes are started (the caller starts other
        roles meanwhile); ``wait_workers(role)`` (or ``get_workers``) waits until they are
        healthy and raises what failed. Start them from the main thread either way: the
        parent-death signal is armed only there (``_popen``)."""
        role = job.role
        with self._lock:
            if self._closed:
                raise RuntimeError("LocalScheduler is closed")
        self._claim_role(role)
        colocated = self._colocate(job)
        if colocated is not None:
            return colocated

        os.makedirs(self.log_dir, exist_ok=True)
        distributed = job.distributed_env
        procs: list[_WorkerProc] = []
        self._roles[role] = procs
        try:
            spec = job.worker_spec
            n_ports = max(spec.port_count, 2 if spec.cmd is None else 1)
            all_ports = [self._allocate_ports(n_ports) for _ in range(job.replicas)]
            master_port = all_ports[0][1] if len(all_ports[0]) > 1 else self._allocate_ports(1)[0]
            base_env = dict(os.environ)
            base_env.update(worker_base_env())
            for i in range(job.replicas):
                ports = all_ports[i]
                env = dict(base_env)
                env["AREAL_WORKER_ID"] = f"{role}/{i}"
                gpus = self._gpus_for(spec)
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
                if distributed if distributed is not None else spec.cmd is None:
                    env.update(
                        RANK=str(i),
                        WORLD_SIZE=str(job.replicas),
                        LOCAL_RANK="0" if gpus else str(i),
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(master_port),
                    )
                env.update(job.env_vars)
                cmd = self._command(spec, ports)
                log_path = os.path.join(self.log_dir, f"{role}-{i}.log")
                log_file = open(log_path, "ab")  # noqa: SIM115 - closed in delete_workers
                proc = self._popen(cmd, env, log_file, "start")
                worker = Worker(
                    id=f"{role}/{i}", ip=self.host, worker_ports=[str(p) for p in ports]
                )
                client = (
                    RPCClient(worker.address, worker_id=worker.id) if spec.cmd is None else None
                )
                procs.append(
                    _WorkerProc(
                        worker,
                        role,
                        i,
                        proc,
                        log_path,
                        log_file,
                        cmd,
                        client,
                        spec=spec,
                        env=env,
                        health_path=job.health_path,
                    )
                )
                logger.info(
                    f"Started {worker.id} pid {proc.pid} on port {ports[0]}; log {log_path}"
                )
            if wait:
                self._finish_start(job, procs)
            else:
                with self._lock:
                    self._starting[role] = _PendingStart(job, procs)
        except BaseException:
            self.delete_workers(role)
            raise
        return [p.worker.id for p in procs]

    def _finish_start(self, job: Job, procs: list[_WorkerProc]) -> None:
        """Wait until the started ``procs`` of ``job`` are healthy; publish their addresses."""
        self._wait_healthy_rebinding(job, procs)
        for p in procs:
            self.name_resolve.add(self._key(job.role, p.index), p.worker.address, replace=True)

    def wait_workers(self, role: str) -> None:
        """Wait until the workers of a role started with ``create_workers(job, wait=False)``
        are healthy (at once for any other role). A failed start stops the role's workers
        and raises what failed, to every caller; safe from several threads."""
        with self._lock:
            pending = self._starting.get(self._aliases.get(role, role))
        if pending is None:
            return
        with pending.lock:
            if not pending.done:
                pending.done = True
                try:
                    self._finish_start(pending.job, pending.procs)
                except BaseException as e:
                    pending.error = e
                    self.delete_workers(pending.job.role)
                finally:
                    with self._lock:
                        if self._starting.get(pending.job.role) is pending:
                            del self._starting[pending.job.role]
        if pending.error is not None:
            raise pending.error

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        self.wait_workers(role)
        return super().get_workers(role, timeout)

    # A worker that lost its port to another process between ``find_free_ports`` and its
    # bind is started again on a fresh port, this many times at most.
    bind_retries = 3

    def _wait_healthy_rebinding(self, job: Job, procs: list[_WorkerProc]) -> None:
        """``_wait_healthy``; a worker that died at startup because its port was taken
        (``EADDRINUSE`` in its log since its last start) is started again on fresh ports,
        at most ``bind_retries`` times. An RPC worker keeps ``worker_ports[1:]`` (rank 0's
        ``worker_ports[1]`` is the job's ``MASTER_PORT``, which the other ranks already
        have); a command worker gets all new ports. Any other death is raised as is."""
        for attempt in range(self.bind_retries + 1):
            try:
                self._wait_healthy(job, procs)
                return
            except WorkerDiedError:
                lost = [
                    p for p in procs if p.proc.poll() is not None and _lost_port_race(p.log_path)
                ]
                if not lost or attempt == self.bind_retries:
                    raise
            for p in lost:
                old = [int(x) for x in p.worker.worker_ports]
                if p.client is not None:
                    ports = self._allocate_ports(1) + old[1:]
                else:
                    ports = self._allocate_ports(len(old))
                assert p.spec is not None and p.env is not None
                cmd = self._command(p.spec, ports)
                with self._lock:
                    if self._closed:
                        raise RuntimeError("LocalScheduler is closed")
                    self._used_ports.difference_update(set(old) - set(ports))
                    p.proc = self._popen(cmd, p.env, p.log_file, "start (port taken)")
                    p.cmd = cmd
                    p.worker.worker_ports = [str(x) for x in ports]
                    if p.client is not None:
                        p.client = RPCClient(p.worker.address, worker_id=p.worker.id)
                logger.warning(
                    f"{p.worker.id}: port {old[0]} was taken by another process before the "
                    f"worker bound it; started again as pid {p.pid} on port {ports[0]}"
                )

    @staticmethod
    def _popen(cmd: list[str], env: dict[str, str], log_file: IO, what: str) -> subprocess.Popen:
        log_file.write(
            f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {shlex.join(cmd)}\n".encode()
        )
        log_file.flush()
        return subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=os.getcwd(),
            start_new_session=True,
            # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: only the
            # main thread, or a thread flagged ``lives_with_process`` (e.g. the
            # ServerWatchdog's spawner), may arm it
            preexec_fn=set_pdeathsig
            if sys.platform == "linux"
            and (
                threading.current_thread() is threading.main_thread()
                or getattr(threading.current_thread(), "lives_with_process", False)
            )
            else None,
        )

    def _wait_healthy(
        self, job: Job | None, procs: list[_WorkerProc], timeout: float | None = None
    ) -> None:
        limit = self.startup_timeout if timeout is None else timeout
        self._poll_healthy(
            procs,
            procs[0].health_path if procs else "/health",  # one job's workers
            deadline=time.monotonic() + limit,
            timed_out=lambda p: TimeoutError(
                f"Worker {p.worker.id} (pid {p.pid}) not healthy at {p.worker.address} within "
                f"{limit:.0f} s\n{log_tail_block(p.log_path)}"
            ),
            interval=0.1,
        )
        role = procs[0].role if procs else "?"
        logger.info(f"Workers of role {role!r} healthy: {[p.worker.id for p in procs]}")

    def _dead_error(self, p: _WorkerProc, during: str = "") -> WorkerDiedError | None:
        return p.dead_error(during) if p.proc.poll() is not None else None

    def worker_pids(self, role: str | None = None) -> list[int]:
        with self._lock:
            roles = [role] if role is not None else list(self._roles)
            return [p.pid for r in roles for p in self._roles.get(self._aliases.get(r, r), [])]

    # ------------------------------------------------------------------ restarts
    def dead_workers(self, role: str) -> list[str]:
        """Ids of the workers of ``role`` that exited on their own (not being stopped).

        An unknown role has no dead workers (``[]``).
        """
        try:
            procs = self._workers(role)
        except KeyError:
            return []
        return [p.worker.id for p in procs if not p.stopping and p.proc.poll() is not None]

    def worker_exit_info(self, worker_id: str) -> str:
        """One paragraph on a (dead) worker: pid, exit code, command and its log tail."""
        return str(self._worker(worker_id).dead_error())

    def restart_worker(self, worker_id: str, timeout: float | None = None) -> Worker:
        """Start a dead *command* worker again in place and wait until it is healthy.

        Same role/index, command, environment and log file (appended to, after a
        ``===== ... restart`` line). The worker keeps its ports when they can be bound
        again, else it gets new ones; the returned ``Worker`` (and ``name_resolve``) has
        the address it serves on now. A restart that fails on the old ports (someone took
        them meanwhile) is retried once on new ports. Raises ``ValueError`` for an RPC
        worker (its engine state would be lost) or a worker that is still alive,
        ``WorkerDiedError`` / ``TimeoutError`` when the new process does not come up
        within ``timeout`` (default ``startup_timeout``) seconds.
        """
        p = self._worker(worker_id)
        if p.client is not None or p.spec is None or p.env is None:
            raise ValueError(
                f"Worker {worker_id} is an RPC worker; only command workers can be restarted"
            )
        if p.proc.poll() is None:
            raise ValueError(f"Worker {worker_id} (pid {p.pid}) is alive; nothing to restart")
        exit_code = p.proc.returncode
        self._signal_group(p, signal.SIGKILL)  # leftovers of the dead process group
        old_ports = [int(x) for x in p.worker.worker_ports]
        attempts = [old_ports] if _can_bind(old_ports, self.host) else []
        attempts.append(None)  # new ports
        last: BaseException | None = None
        for ports in attempts:
            if ports is None:
                ports = self._allocate_ports(len(old_ports))
            cmd = self._command(p.spec, ports)
            with self._lock:
                if self._closed:
                    raise RuntimeError("LocalScheduler is closed")
                p.proc = self._popen(cmd, p.env, p.log_file, "restart")
                p.cmd = cmd
                p.worker.worker_ports = [str(x) for x in ports]
                p.reported = False
                p.restarts += 1
                if ports != old_ports:
                    self._used_ports.difference_update(old_ports)
            logger.warning(
                f"Restarting {worker_id} (previous process exited with code {exit_code}) as pid "
                f"{p.pid} on port {ports[0]}; log {p.log_path}"
            )
            try:
                self._wait_healthy(None, [p], timeout=timeout)
            except (WorkerDiedError, TimeoutError) as e:
                last = e
                if p.proc.poll() is None:  # unhealthy but alive: stop it before the retry
                    self._signal_group(p, signal.SIGKILL)
                    try:
                        p.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                old_ports = ports
                continue
            self.name_resolve.add(self._key(p.role, p.index), p.worker.address, replace=True)
            logger.info(
                f"Worker {worker_id} restarted (restart #{p.restarts}) at {p.worker.address}"
            )
            return p.worker
        assert last is not None
        raise last

    def delete_workers(self, role: str | None = None) -> None:
        """SIGTERM each worker's process group, SIGKILL after ``kill_grace`` s; idempotent."""
        with self._lock:
            roles = self._release_roles(role)
            procs = [p for r in roles for p in self._roles.pop(r)]
            for r in roles:
                self._starting.pop(r, None)
        if not procs:
            return
        for p in procs:
            p.stopping = True
            try:
                p.descendants = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.Error:
                p.descendants = []
            self._signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace
        for p in procs:
            try:
                p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    f"Worker {p.worker.id} (pid {p.pid}) ignored SIGTERM; sending SIGKILL"
                )
        for p in procs:
            self._signal_group(p, signal.SIGKILL)
            for pid in p.descendants:
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error(f"Worker {p.worker.id} (pid {p.pid}) survived SIGKILL")
            p.log_file.close()
            with self._lock:
                for port in p.worker.worker_ports:
                    self._used_ports.discard(int(port))
            try:
                self.name_resolve.delete(self._key(p.role, p.index))
            except KeyError:
                pass
        logger.info(f"Stopped workers {[p.worker.id for p in procs]}")

    @staticmethod
    def _signal_group(p: _WorkerProc, sig: int) -> None:
        try:
            os.killpg(p.pid, sig)  # the worker leads its own session/process group
        except (ProcessLookupError, PermissionError):
            pass
