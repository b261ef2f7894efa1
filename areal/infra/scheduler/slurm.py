"""``SlurmScheduler``: workers as the tasks of Slurm jobs.

A role of RPC workers (``distributed_env``: the training ranks) becomes one batch job with
``--ntasks=replicas``; a role of command workers (inference servers, independent of each
other) becomes one single-task batch job per worker, so that the node running one
server's batch script can die without ending the other servers (a batch job ends with its
batch host, ``--no-kill`` or not). Each job gets ``--cpus-per-task``, ``--mem-per-cpu``
from ``SchedulingSpec.mem`` GB, ``--gpus-per-task`` when ``gpu > 0``, ``--exclude``,
``--reservation`` and ``--exclusive`` from the spec and ``--partition`` from the scheduler; ``--nodelist`` from the spec for the
shared job, its ``i mod n``-th node (``scontrol show hostnames``) for command worker ``i``.
The batch script runs ``srun`` (``--kill-on-bad-exit=1`` for RPC workers) on this module's
task entry (``python -m areal.infra.scheduler.slurm worker ...``), which on each task:

1. takes ``RANK = SLURM_PROCID``, ``WORLD_SIZE = SLURM_NTASKS``, ``LOCAL_RANK =
   SLURM_LOCALID``, finds its node IP and free ports;
2. for RPC workers (``distributed_env``), rank 0 publishes ``MASTER_ADDR:MASTER_PORT`` in the
   file-system name-resolve store (``{fileroot}/name_resolve``, shared by all nodes) and
   every rank waits for it;
3. publishes its address under ``{experiment}/{trial}/slurm/{role}/{rank}`` (JSON: ip,
   ports, pid, host) and ``{experiment}/{trial}/workers/{role}/{rank}`` (``ip:port``);
4. ``exec``s the worker: ``python -m areal.infra.rpc.rpc_server --host IP --port P`` or
   the command worker's ``cmd`` (``{host}``/``{port}``/``{portN}`` filled in).

The controller waits for the addresses and the health endpoints, polls the job state with
``squeue`` (``scontrol show job`` once the job left the queue), and raises
``WorkerDiedError`` naming the worker with the tail of its log when the job ends.
Logs: ``{fileroot}/logs/{experiment}/{trial}/{role}-{rank}.log`` (one per task) and
``{role}-slurm-{jobid}.out`` (the batch script). ``delete_workers`` runs ``scancel`` and
waits until ``squeue`` no longer lists the job. Client commands need ``SLURM_CONF``
(the ``slurm_conf`` argument or the environment) on non-standard installations.

Not acted on here: ``SchedulingSpec.container_type/image/mount`` (tasks run bare, on the
controller's interpreter and ``PYTHONPATH``) and ``srun_additional_args`` (use
``srun_args``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal.api.scheduler_api import Job, Worker, WorkerDiedError
from areal.infra.rpc.client import RPCClient
from areal.infra.scheduler.base import (
    SchedulerBase,
    format_command,
    log_tail_block,
    worker_base_env,
)
from areal.utils import logging
from areal.utils.auth import ensure_run_secret
from areal.utils.name_resolve import (
    Etcd3NameRecordRepository,
    FileNameRecordRepository,
    NameEntryNotFoundError,
)
from areal.utils.network import find_free_ports, gethostip

if TYPE_CHECKING:
    from areal.api.experiment_config import BaseExperimentConfig

logger = logging.getLogger("SlurmScheduler")

ALIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "RESIZING", "SUSPENDED", "REQUEUED")


@dataclass
class _SlurmWorker:
    worker: Worker
    role: str
    index: int
    job_id: str
    log_path: str
    client: RPCClient | None
    info: dict


@dataclass
class _SlurmJob:
    job_id: str
    role: str
    script: str
    batch_log: str
    log_paths: list[str]  # of its tasks, ranks first_rank, first_rank + 1, ...
    first_rank: int = 0
    replacement: bool = False  # started by restart_worker
    state: str = "PENDING"
    checked_at: float = 0.0

    def log_path(self, rank: int) -> str:
        return self.log_paths[rank - self.first_rank]


class SlurmScheduler(SchedulerBase):
    """Slurm scheduler (see module docstring).

    ``exp_config`` supplies ``cluster.fileroot`` (must be shared by all nodes),
    ``experiment_name`` and ``trial_name`` unless given explicitly.
    """

    def __init__(
        self,
        exp_config: BaseExperimentConfig | None = None,
        *,
        fileroot: str | None = None,
        experiment_name: str | None = None,
        trial_name: str | None = None,
        partition: str | None = None,
        slurm_conf: str | None = None,
        sbatch_args: list[str] | None = None,
        srun_args: list[str] | None = None,
        startup_timeout: float = 300.0,
        call_timeout: float | None = None,
        state_poll_interval: float = 2.0,
        command_timeout: float = 60.0,
    ):
        self._init_base(exp_config, fileroot, experiment_name, trial_name)
        self.partition = partition
        # the per-run secret reaches the jobs through sbatch's environment (never the
        # batch script, which is a file on disk)
        ensure_run_secret()
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.sbatch_args = list(sbatch_args or [])
        self.srun_args = list(srun_args or [])
        self.startup_timeout = startup_timeout
        self.call_timeout = call_timeout
        self.state_poll_interval = state_poll_interval
        self.command_timeout = command_timeout
        self.connection_grace = self._connection_grace()
        self.name_resolve_root = os.path.join(self.fileroot, "name_resolve")
        nr = exp_config.cluster.name_resolve if exp_config is not None else None
        # etcd3 (cluster.name_resolve.type): controller and tasks share the server instead
        # of files under fileroot; the other types keep the shared-file-system store.
        self.etcd3_addr = nr.etcd3_addr if nr is not None and nr.type == "etcd3" else None
        self.name_resolve = (
            Etcd3NameRecordRepository(self.etcd3_addr)
            if self.etcd3_addr
            else FileNameRecordRepository(self.name_resolve_root)
        )
        self._jobs: dict[str, list[_SlurmJob]] = {}  # role -> its job(s) at creation
        self._jobs_by_id: dict[str, _SlurmJob] = {}  # role jobs and replacement jobs
        self._lost: set[str] = set()  # worker ids given up by kill_worker
        self._bad_nodes: set[str] = set()  # Slurm nodes a worker was lost on
        self._jobs_spec: dict[str, Job] = {}
        self._node_states: dict[str, tuple[str, float]] = {}  # node -> (sinfo state, when)

    # ------------------------------------------------------------------ lifecycle
    connection_grace = 15.0  # a task's death reaches squeue with some delay

    def _connection_grace(self) -> float:
        """How long a refused connection waits for Slurm's verdict on the worker: a lost
        node shows in ``sinfo`` only after ``SlurmdTimeout``; 2x that + 5 s, in 15..120 s."""
        try:
            out = self._run("scontrol", "show", "config", check=False).stdout
        except (RuntimeError, TimeoutError):
            return 15.0
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "SlurmdTimeout":
                try:
                    return min(120.0, max(15.0, 2 * float(value.split()[0]) + 5))
                except (ValueError, IndexError):
                    break
        return 15.0

    def _prefix(self) -> str:
        return f"{self.experiment_name}/{self.trial_name}"

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            out = subprocess.run(
                list(argv),
                env=self.env,
                capture_output=True,
                text=True,
                timeout=self.command_timeout,
            )
        except FileNotFoundError:
            raise RuntimeError(
                f"{argv[0]} not found: SlurmScheduler needs the Slurm client commands on PATH"
            ) from None
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"`{shlex.join(argv)}` did not answer within {self.command_timeout} s"
            ) from None
        if check and out.returncode != 0:
            raise RuntimeError(
                f"`{shlex.join(argv)}` failed with exit code {out.returncode}: {out.stderr.strip()}"
            )
        return out

    # ------------------------------------------------------------------ job script
    def _script(
        self,
        job: Job,
        log_paths_pattern: str,
        batch_log: str,
        nodelist: str | None = None,
        exclude: str | None = None,
        rank: int | None = None,
    ) -> str:
        spec = job.worker_spec
        is_rpc = spec.cmd is None
        n_ports = max(spec.port_count, 2 if is_rpc else 1)
        distributed = job.distributed_env if job.distributed_env is not None else is_rpc
        cpus = max(1, spec.cpu)
        name = f"areal-{self.experiment_name}-{self.trial_name}-{job.role}"
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={name}" + ("" if rank is None else f"-{rank}"),
            f"#SBATCH --ntasks={job.replicas if rank is None else 1}",
            f"#SBATCH --cpus-per-task={cpus}",
            f"#SBATCH --output={batch_log}",
            f"#SBATCH --chdir={os.getcwd()}",
        ]
        if not distributed:
            # command workers (inference servers) are independent: losing a node or one
            # task must not end the others (restart_worker replaces the lost one)
            lines.append("#SBATCH --no-kill")
        if spec.mem > 0:
            lines.append(f"#SBATCH --mem-per-cpu={math.ceil(spec.mem * 1024 / cpus)}M")
        if spec.gpu > 0:
            lines.append(f"#SBATCH --gpus-per-task={spec.gpu}")
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        nodelist = spec.nodelist if nodelist is None else nodelist
        exclude = spec.exclude if exclude is None else exclude
        if nodelist:
            lines.append(f"#SBATCH --nodelist={nodelist}")
        if exclude:
            lines.append(f"#SBATCH --exclude={exclude}")
        if spec.reservation:
            lines.append(f"#SBATCH --reservation={spec.reservation}")
        if spec.exclusive:
            lines.append("#SBATCH --exclusive")
        env = worker_base_env()
        env.update(job.env_vars)
        lines += [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
        lines += list(spec.additional_bash_cmds or [])
        worker_argv = [
            sys.executable, "-m", "areal.infra.scheduler.slurm", "worker",
            "--name-resolve-root", self.name_resolve_root,
            "--prefix", self._prefix(),
            "--role", job.role,
            "--port-count", str(n_ports),
            "--timeout", str(self.startup_timeout),
        ]  # fmt: skip
        if self.etcd3_addr:
            worker_argv += ["--etcd3-addr", self.etcd3_addr]
        if distributed:
            worker_argv.append("--distributed")
        if rank is not None:
            worker_argv += ["--rank", str(rank)]
        if not is_rpc:
            worker_argv += ["--cmd", json.dumps(spec.cmd)]
        srun = [
            "srun",
            "--kill-on-bad-exit=1" if distributed else "--kill-on-bad-exit=0",
            *([] if distributed else ["--no-kill"]),
            "--unbuffered",
            f"--output={log_paths_pattern}",
            *self.srun_args,
        ]
        lines.append(f"exec {shlex.join(srun)} {shlex.join(worker_argv)}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ workers
    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        """Submit the role's batch job(s) (one, or one per command worker: module docstring)
        and wait until every task is healthy; returns worker ids."""
        role = job.role
        self._claim_role(role)
        colocated = self._colocate(job)
        if colocated is not None:
            return colocated

        self._closed = False
        os.makedirs(self.log_dir, exist_ok=True)
        self.name_resolve.clear_subtree(f"{self._prefix()}/slurm/{role}")
        self.name_resolve.clear_subtree(f"{self._prefix()}/workers/{role}")
        distributed = (
            job.distributed_env if job.distributed_env is not None else job.worker_spec.cmd is None
        )
        sjobs: list[_SlurmJob] = []
        workers: list[_SlurmWorker] = []
        with self._lock:
            self._jobs[role] = sjobs
            self._jobs_spec[role] = job
            self._roles[role] = workers
        try:
            if distributed:
                submits: list[tuple[int | None, str | None]] = [(None, None)]
            else:  # one job per server: no node's death ends another node's server
                nodes = self._hostnames(job.worker_spec.nodelist)
                submits = [
                    (i, nodes[i % len(nodes)] if nodes else None) for i in range(job.replicas)
                ]
            for rank, node in submits:
                sjob = self._submit(job, rank, node)
                with self._lock:
                    sjobs.append(sjob)
                    self._jobs_by_id[sjob.job_id] = sjob
            deadline = time.monotonic() + self.startup_timeout
            for i in range(job.replicas):
                sjob = sjobs[0] if distributed else sjobs[i]
                info = self._wait_address(sjob, role, i, deadline)
                w = Worker(
                    id=f"{role}/{i}", ip=info["ip"], worker_ports=[str(p) for p in info["ports"]]
                )
                workers.append(
                    _SlurmWorker(
                        worker=w,
                        role=role,
                        index=i,
                        job_id=sjob.job_id,
                        log_path=sjob.log_path(i),
                        client=RPCClient(w.address, worker_id=w.id)
                        if job.worker_spec.cmd is None
                        else None,
                        info=info,
                    )
                )
                logger.info(
                    f"Task {w.id} of job {sjob.job_id} on {info['host']} ({w.ip}) ports "
                    f"{info['ports']}; log {sjob.log_path(i)}"
                )
            self._wait_healthy(job, workers, deadline)
        except BaseException:
            self.delete_workers(role)
            raise
        return [w.worker.id for w in workers]

    def _submit(self, job: Job, rank: int | None, node: str | None = None) -> _SlurmJob:
        """``sbatch`` the role's job (``rank`` None: every task) or the one-task job of
        worker ``rank`` (pinned to ``node`` when given)."""
        role = job.role
        tag = role if rank is None else f"{role}-{rank}"
        script_path = os.path.join(self.log_dir, f"{tag}.sbatch")
        batch_log = os.path.join(self.log_dir, f"{tag}-slurm-%j.out")
        log = os.path.join(self.log_dir, f"{role}-%t.log" if rank is None else f"{tag}.log")
        with open(script_path, "w") as f:
            f.write(self._script(job, log, batch_log, nodelist=node, rank=rank))
        out = self._run("sbatch", "--parsable", *self.sbatch_args, script_path)
        job_id = out.stdout.strip().split(";")[0]
        ranks = range(job.replicas) if rank is None else [rank]
        sjob = _SlurmJob(
            job_id=job_id,
            role=role,
            script=script_path,
            batch_log=batch_log.replace("%j", job_id),
            log_paths=[os.path.join(self.log_dir, f"{role}-{i}.log") for i in ranks],
            first_rank=0 if rank is None else rank,
        )
        where = f" on {node}" if node else ""
        logger.info(
            f"Submitted Slurm job {job_id} for role {role!r} "
            + (f"({job.replicas} tasks)" if rank is None else f"(worker {rank}{where})")
        )
        return sjob

    def _hostnames(self, nodelist: str | None) -> list[str]:
        """The node names of a Slurm host list (``n[1-3],m1``), in order."""
        if not nodelist:
            return []
        out = self._run("scontrol", "show", "hostnames", nodelist)
        return out.stdout.split()

    def _job_state(self, sjob: _SlurmJob, max_age: float = 0.0) -> str:
        """Slurm state of the job (cached for ``max_age`` s)."""
        now = time.monotonic()
        if now - sjob.checked_at < max_age:
            return sjob.state
        out = self._run("squeue", "-h", "-j", sjob.job_id, "-o", "%T", check=False)
        state = out.stdout.strip().split("\n")[0].strip() if out.returncode == 0 else ""
        if not state:
            show = self._run("scontrol", "show", "job", "-o", sjob.job_id, check=False)
            fields = dict(
                kv.split("=", 1) for kv in show.stdout.split() if "=" in kv
            )  # JobState=FAILED ExitCode=1:0 ...
            state = fields.get("JobState", "GONE")
            if fields.get("ExitCode"):
                state += f" (exit code {fields['ExitCode']}, reason {fields.get('Reason', '?')})"
        sjob.state, sjob.checked_at = state, now
        return state

    def _job_dead_error(
        self, sjob: _SlurmJob, worker_id: str | None, during: str = "", headline: str = ""
    ) -> str:
        what = f" during {during}" if during else ""
        lines = [
            headline
            or f"Worker {worker_id or sjob.role} (Slurm job {sjob.job_id}, role {sjob.role}) "
            f"is dead{what}: job state {sjob.state}."
        ]
        paths = [sjob.log_path(int(worker_id.rsplit("/", 1)[1]))] if worker_id else sjob.log_paths
        for p in [*paths, sjob.batch_log]:
            lines.append(log_tail_block(p))
        return "\n".join(lines)

    def _wait_address(self, sjob: _SlurmJob, role: str, rank: int, deadline: float) -> dict:
        key = f"{self._prefix()}/slurm/{role}/{rank}"
        while True:
            try:
                return json.loads(self.name_resolve.get(key))
            except NameEntryNotFoundError:
                pass
            state = self._job_state(sjob, max_age=1.0)
            if not state.startswith(ALIVE_STATES):
                raise WorkerDiedError(self._job_dead_error(sjob, f"{role}/{rank}", "startup"))
            if time.monotonic() > deadline:
                reason = self._run(
                    "squeue", "-h", "-j", sjob.job_id, "-o", "%T %r", check=False
                ).stdout.strip()
                headline = (
                    f"Task {role}/{rank} of Slurm job {sjob.job_id} did not publish its "
                    f"address within {self.startup_timeout} s (squeue: {reason or state!r})"
                )
                raise TimeoutError(self._job_dead_error(sjob, f"{role}/{rank}", headline=headline))
            time.sleep(0.2)

    def _wait_healthy(self, job: Job, workers: list[_SlurmWorker], deadline: float) -> None:
        def dead(w: _SlurmWorker) -> WorkerDiedError | None:
            sjob = self._jobs_by_id[w.job_id]
            if self._job_state(sjob, max_age=1.0).startswith(ALIVE_STATES):
                return None
            return WorkerDiedError(self._job_dead_error(sjob, w.worker.id, "startup"))

        def timed_out(w: _SlurmWorker) -> TimeoutError:
            sjob = self._jobs_by_id[w.job_id]
            headline = (
                f"Worker {w.worker.id} not healthy at {w.worker.address} "
                f"within {self.startup_timeout} s (job state {sjob.state})"
            )
            return TimeoutError(self._job_dead_error(sjob, w.worker.id, headline=headline))

        self._poll_healthy(workers, job.health_path, deadline, timed_out, dead=dead)
        logger.info(f"Workers of role {job.role!r} healthy: {[w.worker.id for w in workers]}")

    def _dead_error(self, w: _SlurmWorker, during: str = "") -> WorkerDiedError | None:
        sjob = self._jobs_by_id.get(w.job_id) if w.role in self._jobs else None
        if sjob is None:
            return WorkerDiedError(f"Worker {w.worker.id}: its Slurm job was cancelled")
        state = self._job_state(sjob, max_age=self.state_poll_interval)
        if not state.startswith(ALIVE_STATES):
            return WorkerDiedError(self._job_dead_error(sjob, w.worker.id, during))
        node = w.info.get("node", "")
        node_state = self._node_state(node, max_age=self.state_poll_interval)
        if not self._node_lost(node_state):
            return None
        what = f" during {during}" if during else ""
        return WorkerDiedError(
            f"Worker {w.worker.id} (Slurm job {sjob.job_id}, role {w.role}) is dead{what}: its "
            f"node {node} ({w.worker.ip}) no longer answers slurmctld (sinfo state "
            f"{node_state!r}; job state {state})\n" + log_tail_block(w.log_path)
        )

    # ------------------------------------------------------------------ server faults
    def _node_state(self, node: str, max_age: float = 0.0) -> str:
        """``sinfo``'s state of a Slurm node (``idle``, ``mixed*``, ``down*``, ...); a
        trailing ``*`` means slurmctld gets no answer from the node."""
        if not node:
            return ""
        now = time.monotonic()
        cached = self._node_states.get(node)
        if cached is not None and now - cached[1] < max_age:
            return cached[0]
        out = self._run("sinfo", "-h", "-N", "-n", node, "-o", "%T", check=False)
        state = out.stdout.strip().split("\n")[0].strip() if out.returncode == 0 else ""
        self._node_states[node] = (state, now)
        return state

    @staticmethod
    def _node_lost(state: str) -> bool:
        return state.endswith("*") or state.startswith(("down", "drain", "fail"))

    def dead_workers(self, role: str) -> list[str]:
        """Ids of the command workers of ``role`` that are gone: their job (the role's job or
        their replacement job) ended, their node no longer answers slurmctld
        (``sinfo`` ``*`` / ``down``), or ``kill_worker`` gave them up. RPC-worker roles
        (one ``srun`` step: a lost task ends the job) report every worker once the job ended."""
        try:
            ws = self._workers(role)
        except KeyError:
            return []
        dead = []
        for w in ws:
            sjob = self._jobs_by_id.get(w.job_id)
            if sjob is None:
                continue
            if w.worker.id in self._lost:
                dead.append(w.worker.id)
                continue
            if not self._job_state(sjob, max_age=self.state_poll_interval).startswith(ALIVE_STATES):
                dead.append(w.worker.id)
                continue
            node = w.info.get("node", "")
            if w.client is None and node and self._node_lost(self._node_state(node)):
                self._bad_nodes.add(node)
                dead.append(w.worker.id)
        return dead

    def worker_pids(self, role: str) -> list[int]:
        """Pids the tasks published (on their own nodes)."""
        return [int(w.info.get("pid", 0)) for w in self._workers(role)]

    def worker_exit_info(self, worker_id: str) -> str:
        w = self._worker(worker_id)
        sjob = self._jobs_by_id.get(w.job_id)
        node = w.info.get("node", "")
        state = self._node_state(node) if node else "?"
        job_state = sjob.state if sjob is not None else "?"
        return (
            f"Slurm node {node or '?'} ({w.worker.ip}) state {state!r}, job {w.job_id} state "
            f"{job_state!r}\n" + log_tail_block(w.log_path)
        )

    def kill_worker(self, worker_id: str) -> None:
        """Give up a silent command worker: ``scancel`` its replacement job (a worker's first
        job is left alone: when its node comes back after a cut link, the server there is
        readmitted beside its replacement, see ``ServerWatchdog``) and remember its node
        as suspect, so ``restart_worker`` places the new one elsewhere."""
        w = self._worker(worker_id)
        if w.client is not None:
            raise ValueError(f"Worker {worker_id} is an RPC worker; kill_worker is for servers")
        sjob = self._jobs_by_id.get(w.job_id)
        if sjob is not None and sjob.replacement:
            self._run("scancel", "--signal=KILL", "--full", w.job_id, check=False)
        node = w.info.get("node", "")
        if node:
            self._bad_nodes.add(node)
        self._lost.add(worker_id)
        logger.warning(
            f"Gave up worker {worker_id} on Slurm node {node or '?'} ({w.worker.address}): "
            "silent past its health deadline"
        )

    def restart_worker(self, worker_id: str, timeout: float | None = None) -> Worker:
        """Start a dead command worker again as a one-task Slurm job of its own (same
        command; rank and name-resolve keys of the old one), on a node with room that is
        not one a worker was lost on (``--exclude``); waits until it is healthy."""
        w = self._worker(worker_id)
        if w.client is not None:
            raise ValueError(f"Worker {worker_id} is an RPC worker; only servers are restarted")
        if worker_id not in self.dead_workers(w.role):
            raise ValueError(f"Worker {worker_id} is alive; restart_worker needs a dead one")
        job = self._jobs_spec[w.role]
        spec = job.worker_spec
        names = self._run(
            "sinfo",
            "-h",
            "-N",
            "-o",
            "%N",
            *([f"--nodes={spec.nodelist}"] if spec.nodelist else []),
        ).stdout.split()
        bad = sorted(self._bad_nodes & set(names))
        if bad and not set(names) - set(bad):  # nowhere else to go: try the same node(s)
            logger.warning(f"no node but {bad} can take {worker_id}; restarting it there")
            bad = []
        exclude = ",".join(sorted({*bad, *([spec.exclude] if spec.exclude else [])}))
        nodelist = spec.nodelist
        if nodelist and bad:
            nodelist = ",".join(n for n in dict.fromkeys(names) if n not in bad) or None
        idx = w.index
        old = self._jobs_by_id.get(w.job_id)
        if old is not None and old.replacement:  # a replacement job: stop what is left
            self._run("scancel", "--full", old.job_id, check=False)
        script_path = os.path.join(self.log_dir, f"{w.role}-{idx}-restart.sbatch")
        batch_log = os.path.join(self.log_dir, f"{w.role}-{idx}-slurm-%j.out")
        with open(script_path, "w") as f:
            f.write(
                self._script(
                    job, w.log_path + ".restart", batch_log, nodelist or "", exclude, rank=idx
                )
            )
        key = f"{self._prefix()}/slurm/{w.role}/{idx}"
        self.name_resolve.add(key, json.dumps({"restarting": True}), replace=True)
        out = self._run("sbatch", "--parsable", *self.sbatch_args, script_path)
        job_id = out.stdout.strip().split(";")[0]
        sjob = _SlurmJob(
            job_id=job_id,
            role=f"{w.role}/{idx}",
            script=script_path,
            batch_log=batch_log.replace("%j", job_id),
            log_paths=[w.log_path + ".restart"],
            first_rank=idx,
            replacement=True,
        )
        logger.info(
            f"Restarting worker {worker_id} as Slurm job {job_id}"
            + (f" (--exclude={exclude})" if exclude else "")
        )
        self._jobs_by_id[job_id] = sjob
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while True:
            info = json.loads(self.name_resolve.get(key))
            if info.get("job_id") == job_id:
                break
            if not self._job_state(sjob, max_age=1.0).startswith(ALIVE_STATES):
                raise WorkerDiedError(self._job_dead_error(sjob, None, "restart"))
            if time.monotonic() > deadline:
                self._run("scancel", job_id, check=False)
                raise TimeoutError(f"restart of {worker_id} (job {job_id}) published no address")
            time.sleep(0.2)
        new = Worker(id=worker_id, ip=info["ip"], worker_ports=[str(p) for p in info["ports"]])
        rec = _SlurmWorker(
            worker=new, role=w.role, index=idx, job_id=job_id, log_path=w.log_path + ".restart",
            client=None, info=info,
        )  # fmt: skip

        def timed_out(_w: _SlurmWorker) -> TimeoutError:
            return TimeoutError(f"restarted {worker_id} not healthy at {new.address}")

        def dead(_w: _SlurmWorker) -> WorkerDiedError | None:
            if self._job_state(sjob, max_age=1.0).startswith(ALIVE_STATES):
                return None
            return WorkerDiedError(self._job_dead_error(sjob, None, "restart"))

        self._poll_healthy([rec], job.health_path, deadline, timed_out, dead=dead)
        with self._lock:
            self._roles[w.role][idx] = rec
        self._lost.discard(worker_id)
        logger.info(
            f"Worker {worker_id} restarted by job {job_id} on {info.get('node')} ({new.address})"
        )
        return new

    def job_id(self, role: str) -> str:
        """Slurm job id of a role's workers (of its first worker where each has a job)."""
        return self.job_ids(role)[0]

    def job_ids(self, role: str) -> list[str]:
        """Slurm job ids the role's workers were created in (one, or one per worker)."""
        with self._lock:
            return [j.job_id for j in self._jobs[self._aliases.get(role, role)]]

    def worker_info(self, worker_id: str) -> dict:
        """``ip``, ``ports``, ``pid`` and ``host`` as published by the task."""
        return dict(self._worker(worker_id).info)

    def delete_workers(self, role: str | None = None) -> None:
        """``scancel`` the jobs of ``role`` (all if None) and wait until squeue drops them."""
        with self._lock:
            roles = [r for r in self._release_roles(role) if r in self._jobs]
            jobs = [j for r in roles for j in self._jobs.pop(r)]
            jobs += [  # replacement jobs of restarted workers
                j
                for j in self._jobs_by_id.values()
                if j.replacement and j.role.rpartition("/")[0] in roles
            ]
            for j in jobs:
                self._jobs_by_id.pop(j.job_id, None)
            for r in roles:
                self._roles.pop(r, None)
        if not jobs:
            return
        ids = [j.job_id for j in jobs]
        try:
            self._run("scancel", *ids, check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                out = self._run("squeue", "-h", "-j", ",".join(ids), "-o", "%i", check=False)
                if out.returncode != 0 or not out.stdout.strip():
                    break
                time.sleep(0.5)
            else:
                logger.error(f"Slurm jobs {ids} still listed by squeue 60 s after scancel")
        except Exception as e:  # noqa: BLE001 - keep cleaning up
            logger.error(f"scancel {ids} failed: {e}")
        for r in dict.fromkeys(j.role for j in jobs):
            self.name_resolve.clear_subtree(f"{self._prefix()}/slurm/{r}")
            self.name_resolve.clear_subtree(f"{self._prefix()}/workers/{r}")
        logger.info(f"Cancelled Slurm jobs {ids} (roles {roles})")


# ---------------------------------------------------------------------------- task entry
def _task_main(args: argparse.Namespace) -> None:
    """One Slurm task: publish the address, set torch.distributed env, exec the worker."""
    import socket

    rank = int(os.environ.get("SLURM_PROCID", "0")) if args.rank is None else args.rank
    world = int(os.environ.get("SLURM_NTASKS", "1"))
    local_rank = os.environ.get("SLURM_LOCALID", "0")
    ip = os.environ.get("AREAL_WORKER_HOST") or gethostip()
    ports = find_free_ports(args.port_count, host=ip)
    nr = (
        Etcd3NameRecordRepository(args.etcd3_addr)
        if args.etcd3_addr
        else FileNameRecordRepository(args.name_resolve_root)
    )
    base = f"{args.prefix}/slurm/{args.role}"
    env = dict(os.environ, AREAL_WORKER_ID=f"{args.role}/{rank}")
    if args.distributed:
        if rank == 0:
            master_port = ports[1] if len(ports) > 1 else find_free_ports(1, host=ip)[0]
            nr.add(f"{base}/master", f"{ip}:{master_port}", replace=True)
        master = nr.wait(f"{base}/master", timeout=args.timeout)
        master_addr, master_port = master.rsplit(":", 1)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=local_rank,
            MASTER_ADDR=master_addr,
            MASTER_PORT=master_port,
        )
    if args.cmd is None:
        argv = [
            sys.executable, "-m", "areal.infra.rpc.rpc_server",
            "--host", ip, "--port", str(ports[0]),
        ]  # fmt: skip
    else:
        argv = format_command(json.loads(args.cmd), ip, ports)
    info = {
        "ip": ip,
        "ports": ports,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME", ""),  # Slurm's node name
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
    }
    nr.add(f"{args.prefix}/workers/{args.role}/{rank}", f"{ip}:{ports[0]}", replace=True)
    nr.add(f"{base}/{rank}", json.dumps(info), replace=True)
    logger.info(f"Slurm task {args.role}/{rank} on {info['host']}: exec {shlex.join(argv)}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="areal Slurm task entry (used by SlurmScheduler)")
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("worker", help="run one worker task")
    w.add_argument("--name-resolve-root", required=True)
    w.add_argument("--etcd3-addr", default=None, help="host:port of etcd (else the file store)")
    w.add_argument("--prefix", required=True)
    w.add_argument("--role", required=True)
    w.add_argument("--port-count", type=int, default=2)
    w.add_argument("--distributed", action="store_true")
    w.add_argument("--cmd", default=None, help="JSON of the command (string or argv list)")
    w.add_argument("--timeout", type=float, default=300.0)
    w.add_argument("--rank", type=int, default=None, help="rank of a replacement task")
    _task_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
