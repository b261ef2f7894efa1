"""``RayScheduler``: workers as Ray actors on a Ray cluster.

Connecting: ``address`` argument, else ``$RAY_ADDRESS`` (e.g. ``auto`` or
``ray://head:10001``), else a local Ray is started (``ray.init(address="local",
num_cpus=...)``) on the first ``create_workers`` and shut down again by
``delete_workers()`` (all roles) / ``close()``. A Ray that was already initialised in
this process is used as is and never shut down here.

Placement: each job gets one placement group of ``replicas`` bundles
``{"CPU": spec.cpu, "GPU": spec.gpu}`` (strategy ``PACK``, or ``placement_strategy``);
worker ``i`` is an actor pinned to bundle ``i``. ``spec.nodelist`` (comma-separated node
IPs or hostnames of alive Ray nodes) pins bundle ``i`` to node ``i mod n`` of the list
through Ray's per-node resource ``node:<ip>``, as Slurm spreads ``--ntasks`` over the
nodes of a ``--nodelist``; ``spec.exclude`` is refused (no Ray equivalent here).

Two actor kinds (``areal.infra.scheduler.ray_actors``; threaded, ``max_concurrency=4``):

- RPC workers (``SchedulingSpec.cmd is None``) run the ``rpc_server`` HTTP app
  (``EngineHost`` + ``build_app``) on a thread inside the actor, bound to the node IP.
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (rank 0's node IP) and
  ``MASTER_PORT`` are set in the actor's environment before any engine is created.
- Command workers (``cmd`` set, e.g. an inference server) run the command as a
  subprocess of the actor (own process group, killed with the actor); its output goes
  to the worker's log file and is forwarded to the actor's stdout (Ray's log dir, and the
  driver when ``log_to_driver``).

Addresses come from the actors themselves (``node_info()``: node IP + free ports on that
node), not from a shared file system; they are also published in the Ray name-resolve
store (``RayNameRecordRepository``, a named detached actor) under
``{experiment}/{trial}/workers/{role}/{i}`` and removed on teardown.

Logs: ``{fileroot}/logs/{experiment}/{trial}/{role}-{i}.log`` on the worker's node
(areal log records of RPC workers; full output of command workers), plus each actor's
stdout/stderr under Ray's session log dir (``/tmp/ray/session_latest/logs/worker-*``).

Failures: every actor has a pending ``run_until_stopped()`` call; when the actor dies
(``RayActorError``) or its command exits, ``get_workers`` / ``call_engine`` raise
``WorkerDiedError`` naming the worker, with the tail of its log when readable here.

Server faults (used by ``ServerWatchdog``): ``dead_workers`` lists command workers whose
actor died (its node too) or whose command exited; ``kill_worker`` ``ray.kill``s a silent
one and marks its node suspect; ``restart_worker`` starts the same command as a new actor
pinned (``node:<ip>``) to an alive node that was not lost, the ``nodelist`` nodes first,
where this scheduler's workers leave the bundle's CPUs free (else sharing the first such
node's CPUs, with a warning), outside the role's placement group.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.api.scheduler_api import Job, SchedulingSpec, Worker, WorkerDiedError
from areal.infra.rpc.client import RPCClient
from areal.infra.scheduler.base import (
    LOG_TAIL_LINES,
    SchedulerBase,
    call_with_liveness,
    format_command,
    log_tail_block,
    read_log_tail,
    worker_base_env,
)
from areal.infra.scheduler.ray_actors import CommandWorkerActor, RPCWorkerActor
from areal.utils import logging
from areal.utils.auth import RUN_SECRET_ENV, ensure_run_secret

if TYPE_CHECKING:
    from areal.api.experiment_config import BaseExperimentConfig

logger = logging.getLogger("RayScheduler")

# re-exported: older imports of these helpers name this module
__all__ = [
    "LOG_TAIL_LINES",
    "CommandWorkerActor",
    "RPCWorkerActor",
    "RayScheduler",
    "call_with_liveness",
    "format_command",
    "read_log_tail",
]


# ---------------------------------------------------------------------------- scheduler
@dataclass
class _RayWorker:
    worker: Worker
    role: str
    index: int
    actor: Any
    sentinel: Any  # ObjectRef of run_until_stopped()
    log_path: str
    node_id: str
    client: RPCClient | None
    cmd: list[str] | None = None
    stopping: bool = False
    env: dict[str, str] | None = None  # what ``start`` got (``restart_worker`` reuses it)


class RayScheduler(SchedulerBase):
    """Ray actor scheduler (see module docstring).

    ``exp_config`` supplies ``cluster.fileroot``, ``experiment_name``, ``trial_name`` and
    ``cluster.name_resolve.ray_actor_name`` unless given explicitly.
    """

    def __init__(
        self,
        exp_config: BaseExperimentConfig | None = None,
        *,
        address: str | None = None,
        fileroot: str | None = None,
        experiment_name: str | None = None,
        trial_name: str | None = None,
        num_cpus: int | None = None,
        namespace: str = "areal",
        startup_timeout: float = 180.0,
        call_timeout: float | None = None,
        kill_grace: float = 5.0,
        placement_strategy: str = "PACK",
    ):
        self._init_base(exp_config, fileroot, experiment_name, trial_name)
        nr = exp_config.cluster.name_resolve if exp_config is not None else None
        self.name_resolve_actor = (nr.ray_actor_name if nr else None) or "ray_kv_store"
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.num_cpus = num_cpus
        self.namespace = namespace
        self.startup_timeout = startup_timeout
        self.call_timeout = call_timeout
        self.kill_grace = kill_grace
        self.placement_strategy = placement_strategy
        self._pgs: dict[str, Any] = {}
        self._jobs_spec: dict[str, Job] = {}
        self._lost: set[str] = set()  # worker ids given up by kill_worker
        self._bad_nodes: set[str] = set()  # node IPs a worker was lost on
        self._started_ray = False
        self._name_resolve = None

    # ------------------------------------------------------------------ ray session
    def _ensure_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.address:
            logger.info(f"Connecting to Ray cluster at {self.address}")
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=True)
        else:
            num_cpus = self.num_cpus or os.cpu_count() or 1
            logger.info(f"Starting a local Ray (num_cpus={num_cpus})")
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                namespace=self.namespace,
                log_to_driver=True,
            )
            self._started_ray = True

    @property
    def name_resolve(self):
        from areal.utils.name_resolve import RayNameRecordRepository

        if self._name_resolve is None:
            self._ensure_ray()
            self._name_resolve = RayNameRecordRepository(
                self.name_resolve_actor, namespace=self.namespace
            )
        return self._name_resolve

    def close(self) -> None:
        """Kill every actor, remove placement groups, shut down a Ray started here."""
        super().close()

    # ------------------------------------------------------------------ workers
    def _bundle(self, spec: SchedulingSpec) -> dict[str, float]:
        """``{"CPU", "GPU"}`` of one worker; CPUs are capped at the largest node's count."""
        import ray

        bundle = {}
        if spec.cpu > 0:
            node_cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
            cap = max(node_cpus, default=spec.cpu) or spec.cpu
            if spec.cpu > cap:
                logger.warning(
                    f"A worker asks for {spec.cpu} CPUs; the largest Ray node has {cap}: using {cap}"
                )
            bundle["CPU"] = float(min(spec.cpu, cap))
        if spec.gpu > 0:
            bundle["GPU"] = float(spec.gpu)
        return bundle or {"CPU": 0.01}

    def _node_pins(self, spec: SchedulingSpec, replicas: int) -> list[dict[str, float]]:
        """Per-bundle ``{"node:<ip>": 0.001}`` from ``spec.nodelist`` (``[{}] * n`` without one)."""
        import ray

        if spec.exclude:
            raise ValueError(
                f"SchedulingSpec.exclude={spec.exclude!r} is not supported by the Ray "
                "scheduler; name the nodes to use in SchedulingSpec.nodelist instead"
            )
        if not spec.nodelist:
            return [{} for _ in range(replicas)]
        alive = [n for n in ray.nodes() if n.get("Alive")]
        by_name: dict[str, str] = {}
        for n in alive:
            ip = n["NodeManagerAddress"]
            for key in (ip, n.get("NodeManagerHostname"), n.get("NodeID")):
                if key:
                    by_name.setdefault(key, ip)
        ips = []
        for entry in (e.strip() for e in spec.nodelist.split(",")):
            if not entry:
                continue
            if entry not in by_name:
                raise ValueError(
                    f"SchedulingSpec.nodelist={spec.nodelist!r}: no alive Ray node is "
                    f"{entry!r}; nodes (IP / hostname): "
                    f"{sorted((n['NodeManagerAddress'], n.get('NodeManagerHostname')) for n in alive)}"
                )
            ips.append(by_name[entry])
        if not ips:
            raise ValueError(f"SchedulingSpec.nodelist={spec.nodelist!r} names no node")
        return [{f"node:{ips[i % len(ips)]}": 0.001} for i in range(replicas)]

    def _wait(self, ref, what: str, timeout: float | None = None) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.startup_timeout if timeout is None else timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{what} did not finish within {self.startup_timeout} s; Ray resources "
                f"available: {ray.available_resources()}, total: {ray.cluster_resources()}"
            ) from None

    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        """Start the workers of ``job`` as actors and wait until all are healthy; returns their ids.

        1. a placement group with one bundle per replica (pinned to ``nodelist`` nodes);
        2. one actor per bundle (:meth:`_spawn_actors`), each reporting its node, ip and
           free ports (:meth:`_collect_workers`);
        3. the workers started with their environment (rank, master address) and waited
           for until healthy (:meth:`_start_workers`); their addresses registered.
        """
        role = job.role
        self._claim_role(role)
        colocated = self._colocate(job)
        if colocated is not None:
            return colocated

        self._ensure_ray()
        self._closed = False
        is_rpc = job.worker_spec.cmd is None
        workers: list[_RayWorker] = []
        with self._lock:
            self._roles[role] = workers
            self._jobs_spec[role] = job
        try:
            pending = self._spawn_actors(job, is_rpc)
            infos = self._collect_workers(role, pending, is_rpc, workers)
            self._start_workers(job, workers, infos, is_rpc)
            self._wait_healthy(job, workers)
            for w in workers:
                self.name_resolve.add(self._key(role, w.index), w.worker.address, replace=True)
        except BaseException:
            self.delete_workers(role, _shutdown=False)
            raise
        return [w.worker.id for w in workers]

    def _spawn_actors(self, job: Job, is_rpc: bool) -> list[tuple[Any, Any]]:
        """The role's placement group and one actor per bundle: (actor, node_info ref)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role, spec = job.role, job.worker_spec
        n_ports = max(spec.port_count, 2 if is_rpc else 1)
        bundle = self._bundle(spec)
        pins = self._node_pins(spec, job.replicas)
        pg = placement_group(
            [dict(bundle, **pin) for pin in pins],
            strategy=self.placement_strategy,
            name=f"{self.experiment_name}/{self.trial_name}/{role}",
        )
        self._pgs[role] = pg
        where = f" on {sorted({k for p in pins for k in p})}" if spec.nodelist else ""
        self._wait(
            pg.ready(),
            f"Placement group of role {role!r} ({job.replicas} x {bundle}{where})",
        )
        env_vars = worker_base_env()
        env_vars.update(job.env_vars)
        pending = []
        for i in range(job.replicas):
            wid = f"{role}/{i}"
            actor = (
                ray.remote(RPCWorkerActor if is_rpc else CommandWorkerActor)
                .options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=spec.gpu,
                    max_concurrency=4,
                    max_restarts=0,
                    name=f"{self.experiment_name}/{self.trial_name}/{wid}",
                    namespace=self.namespace,
                    runtime_env={"env_vars": dict(env_vars, AREAL_WORKER_ID=wid)},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg,
                        placement_group_bundle_index=i,
                        placement_group_capture_child_tasks=True,
                    ),
                )
                .remote(wid, os.path.join(self.log_dir, f"{role}-{i}.log"))
            )
            pending.append((actor, actor.node_info.remote(n_ports)))
        return pending

    def _collect_workers(
        self, role: str, pending: list[tuple[Any, Any]], is_rpc: bool, workers: list[_RayWorker]
    ) -> list[dict[str, Any]]:
        """Wait for every actor's node info; append its ``_RayWorker`` to ``workers``."""
        infos = []
        for i, (actor, ref) in enumerate(pending):
            info = self._wait_actor(ref, f"{role}/{i}", "start-up (node_info)")
            infos.append(info)
            w = Worker(
                id=f"{role}/{i}",
                ip=info["ip"],
                worker_ports=[str(p) for p in info["ports"]],
            )
            workers.append(
                _RayWorker(
                    worker=w,
                    role=role,
                    index=i,
                    actor=actor,
                    sentinel=actor.run_until_stopped.remote(),
                    log_path=info["log_path"],
                    node_id=info["node_id"],
                    client=RPCClient(w.address, worker_id=w.id) if is_rpc else None,
                )
            )
            logger.info(
                f"Actor {w.id} pid {info['pid']} on node {info['ip']} ports {info['ports']}; "
                f"log {info['log_path']}"
            )
        return infos

    def _start_workers(
        self, job: Job, workers: list[_RayWorker], infos: list[dict[str, Any]], is_rpc: bool
    ) -> None:
        """Start each worker (RPC server or command) with its environment; the ranks of a
        distributed role get RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT."""
        spec = job.worker_spec
        dist_env = job.distributed_env if job.distributed_env is not None else is_rpc
        master_addr, master_port = infos[0]["ip"], None
        if dist_env:
            ports0 = infos[0]["ports"]
            master_port = (
                ports0[1]
                if len(ports0) > 1
                else self._wait_actor(
                    workers[0].actor.node_info.remote(1), workers[0].worker.id, "node_info"
                )["ports"][0]
            )
        starts = []
        for i, w in enumerate(workers):
            # Ray workers do not inherit our environment: the run secret travels with
            # the (Ray-internal) start call
            env = {RUN_SECRET_ENV: ensure_run_secret()}
            if dist_env:
                same_node = sum(1 for j in range(i) if infos[j]["ip"] == infos[i]["ip"])
                env.update(
                    RANK=str(i),
                    WORLD_SIZE=str(job.replicas),
                    LOCAL_RANK="0" if spec.gpu > 0 else str(same_node),
                    MASTER_ADDR=master_addr,
                    MASTER_PORT=str(master_port),
                )
            w.env = env
            if is_rpc:
                starts.append(w.actor.start.remote(int(w.worker.serve_port), env))
            else:
                w.cmd = format_command(
                    spec.cmd, w.worker.ip, [int(p) for p in w.worker.worker_ports]
                )
                starts.append(w.actor.start.remote(w.cmd, env, os.getcwd()))
        for w, ref in zip(workers, starts, strict=True):
            self._wait_actor(ref, w.worker.id, "start", w)

    def _wait_actor(self, ref, worker_id: str, what: str, w: _RayWorker | None = None) -> Any:
        import ray

        try:
            return self._wait(ref, f"Worker {worker_id}: {what}")
        except ray.exceptions.RayActorError as e:
            raise self._died(worker_id, f"died during {what}: {e}", w) from None
        except ray.exceptions.RayTaskError as e:
            raise WorkerDiedError(f"Worker {worker_id}: {what} failed: {e}") from None

    def _died(self, worker_id: str, detail: str, w: _RayWorker | None = None) -> WorkerDiedError:
        where = ""
        if w is not None:
            cmd = f" Command: {shlex.join(w.cmd)}." if w.cmd else ""
            where = (
                f" (Ray actor on node {w.worker.ip}, role={w.role}, index={w.index}).{cmd}\n"
                f"{log_tail_block(w.log_path)}"
                f"(actor stdout/stderr: Ray's session log dir, logs/worker-*)"
            )
        return WorkerDiedError(f"Worker {worker_id} is dead: {detail}{where}")

    def _dead_error(self, w: _RayWorker, during: str = "") -> WorkerDiedError | None:
        """A ``WorkerDiedError`` if the actor died or its command exited, else None."""
        import ray

        ready, _ = ray.wait([w.sentinel], timeout=0)
        if not ready:
            return None
        what = f" during {during}" if during else ""
        try:
            code = ray.get(w.sentinel, timeout=10)
            detail = f"its command exited with code {code}{what}"
        except ray.exceptions.RayActorError as e:
            detail = f"Ray actor died{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        except Exception as e:  # noqa: BLE001
            detail = f"actor failed{what}: {e!r}"
        return self._died(w.worker.id, detail, w)

    def _wait_healthy(self, job: Job, workers: list[_RayWorker]) -> None:
        self._poll_healthy(
            workers,
            job.health_path,
            deadline=time.monotonic() + self.startup_timeout,
            timed_out=lambda w: TimeoutError(
                f"Worker {w.worker.id} not healthy at {w.worker.address} within "
                f"{self.startup_timeout} s\n{log_tail_block(w.log_path)}"
            ),
        )
        logger.info(f"Workers of role {job.role!r} healthy: {[w.worker.id for w in workers]}")

    # ------------------------------------------------------------------ server faults
    def _node_alive(self, node_id: str) -> bool:
        import ray

        return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())

    def dead_workers(self, role: str) -> list[str]:
        """Ids of the workers of ``role`` that are gone: the actor died (its node too) or
        its command exited, or ``kill_worker`` gave them up."""
        import ray

        try:
            ws = self._workers(role)
        except KeyError:
            return []
        dead = []
        for w in ws:
            if w.stopping:
                continue
            if w.worker.id in self._lost or ray.wait([w.sentinel], timeout=0)[0]:
                dead.append(w.worker.id)
                if not self._node_alive(w.node_id):
                    self._bad_nodes.add(w.worker.ip)
        return dead

    def worker_exit_info(self, worker_id: str) -> str:
        w = self._worker(worker_id)
        alive = "alive" if self._node_alive(w.node_id) else "dead"
        return f"Ray node {w.worker.ip} ({alive} in Ray's node table)\n" + log_tail_block(
            w.log_path
        )

    def kill_worker(self, worker_id: str) -> None:
        """Give up a silent command worker: ``ray.kill`` its actor (its command dies with
        it) and remember its node as suspect, so ``restart_worker`` places the new one on
        another node."""
        import ray

        w = self._worker(worker_id)
        if w.client is not None:
            raise ValueError(f"Worker {worker_id} is an RPC worker; kill_worker is for servers")
        self._lost.add(worker_id)
        self._bad_nodes.add(w.worker.ip)
        try:
            ray.kill(w.actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already dead, or its node unreachable
            logger.debug(f"ray.kill({worker_id}): {e}")
        logger.warning(
            f"Gave up worker {worker_id} on Ray node {w.worker.ip} ({w.worker.address}): "
            "silent past its health deadline"
        )

    def _restart_plan(self, spec: SchedulingSpec, cpus: float) -> list[tuple[str, float]]:
        """(node IP, CPUs) to try for a restarted worker: alive nodes (the spec's
        ``nodelist`` first) not lost before, that have ``cpus`` left beside this
        scheduler's workers; then the first of them (or of all alive nodes) sharing its
        CPUs (``num_cpus=0``) when none has room."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total = {n["NodeManagerAddress"]: n["Resources"].get("CPU", 0.0) for n in nodes}
        by_name = {
            k: n["NodeManagerAddress"]
            for n in nodes
            for k in (n["NodeManagerAddress"], n.get("NodeManagerHostname"), n.get("NodeID"))
            if k
        }
        listed = [by_name.get(e.strip(), "") for e in (spec.nodelist or "").split(",")]
        order = [ip for ip in dict.fromkeys([*listed, *total]) if ip in total]
        good = [ip for ip in order if ip not in self._bad_nodes] or order
        used = dict.fromkeys(total, 0.0)
        with self._lock:
            for role, ws in self._roles.items():
                held = self._bundle(self._jobs_spec[role].worker_spec).get("CPU", 0.0)
                for w in ws:
                    if w.worker.id not in self._lost and w.worker.ip in used:
                        used[w.worker.ip] += held
        plan = [(ip, cpus) for ip in good if total[ip] - used[ip] >= cpus]
        return plan + [(good[0], 0.0)] if good else plan

    def restart_worker(self, worker_id: str, timeout: float | None = None) -> Worker:
        """Start a dead command worker again (same command and environment) as a new actor
        pinned (``node:<ip>``) to an alive node with room that is not the one it was lost
        on (``_restart_plan``); waits until it is healthy."""
        import ray

        w = self._worker(worker_id)
        if w.client is not None or w.cmd is None:
            raise ValueError(f"Worker {worker_id} is an RPC worker; only servers are restarted")
        if worker_id not in self.dead_workers(w.role):
            raise ValueError(f"Worker {worker_id} is alive; restart_worker needs a dead one")
        job = self._jobs_spec[w.role]
        spec = job.worker_spec
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        tried = []
        env_vars = {**worker_base_env(), **job.env_vars, "AREAL_WORKER_ID": worker_id}
        for ip, cpus in self._restart_plan(spec, self._bundle(spec).get("CPU", 0.0)):
            if cpus == 0:
                logger.warning(f"no Ray node has room for {worker_id}: it shares node {ip}'s CPUs")
            actor = (
                ray.remote(CommandWorkerActor)
                .options(
                    num_cpus=cpus,
                    num_gpus=spec.gpu,
                    resources={f"node:{ip}": 0.001},
                    max_concurrency=4,
                    max_restarts=0,
                    namespace=self.namespace,
                    runtime_env={"env_vars": env_vars},
                )  # fmt: skip
                .remote(worker_id, w.log_path)
            )
            try:  # an actor that cannot be placed stays pending: try the next node
                left = max(1.0, min(30.0, deadline - time.monotonic()))
                info = ray.get(actor.node_info.remote(max(spec.port_count, 1)), timeout=left)
                break
            except Exception as e:  # noqa: BLE001 - GetTimeoutError, the actor died
                tried.append(f"{ip}: {type(e).__name__}")
                ray.kill(actor, no_restart=True)
        else:
            raise TimeoutError(f"no Ray node could take {worker_id} (tried {tried})")
        new = Worker(id=worker_id, ip=info["ip"], worker_ports=[str(p) for p in info["ports"]])
        cmd = format_command(spec.cmd, new.ip, [int(p) for p in info["ports"]])
        rec = _RayWorker(
            worker=new, role=w.role, index=w.index, actor=actor, sentinel=None,
            log_path=info["log_path"], node_id=info["node_id"], client=None, cmd=cmd, env=w.env,
        )  # fmt: skip
        try:
            start = actor.start.remote(cmd, w.env or {}, os.getcwd())
            self._wait_actor(start, worker_id, "start", rec)
            rec.sentinel = actor.run_until_stopped.remote()
            self._poll_healthy(
                [rec], job.health_path, deadline,
                lambda r: TimeoutError(f"restarted {worker_id} not healthy at {new.address}"),
            )  # fmt: skip
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        with self._lock:
            self._roles[w.role][w.index] = rec
        self._lost.discard(worker_id)
        self.name_resolve.add(self._key(w.role, w.index), new.address, replace=True)
        logger.info(
            f"Worker {worker_id} restarted on Ray node {new.ip} ({new.address}); it was on "
            f"node {w.worker.ip}"
        )
        return new

    def actor_handle(self, worker_id: str) -> Any:
        """The Ray actor of a worker (tests and debugging)."""
        return self._worker(worker_id).actor

    def delete_workers(self, role: str | None = None, _shutdown: bool = True) -> None:
        """Kill the actors of ``role`` (all if None) and remove their placement groups.

        With ``role=None`` a Ray started by this scheduler is shut down as well.
        """
        with self._lock:
            roles = self._release_roles(role)
            workers = [w for r in roles for w in self._roles.pop(r)]
            pgs = [self._pgs.pop(r) for r in roles if r in self._pgs]
        if workers or pgs:
            self._kill(workers, pgs)
        if role is None and _shutdown:
            self._shutdown_ray()

    def _kill(self, workers: list[_RayWorker], pgs: list[Any]) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        stops = []
        for w in workers:
            w.stopping = True
            if w.cmd is not None:
                try:
                    stops.append(w.actor.stop.remote(self.kill_grace))
                except Exception:  # noqa: BLE001
                    pass
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.kill_grace + 5)
        for w in workers:
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                logger.debug(f"ray.kill({w.worker.id}): {e}")
        deadline = time.monotonic() + 30
        for w in workers:
            try:
                ray.wait([w.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                pass
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001
                logger.warning(f"remove_placement_group failed: {e}")
        if self._name_resolve is not None:
            for w in workers:
                try:
                    self._name_resolve.delete(self._key(w.role, w.index))
                except KeyError:
                    pass
                except Exception as e:  # noqa: BLE001
                    logger.debug(f"name_resolve delete failed: {e}")
        if workers:
            logger.info(f"Stopped actors {[w.worker.id for w in workers]}")

    def _shutdown_ray(self) -> None:
        import ray

        if self._name_resolve is not None and ray.is_initialized():
            try:
                self._name_resolve.clear_subtree(f"{self.experiment_name}/{self.trial_name}")
                if self._started_ray:
                    self._name_resolve.destroy()
            except Exception as e:  # noqa: BLE001
                logger.debug(f"name_resolve clean-up failed: {e}")
        self._name_resolve = None
        if self._started_ray and ray.is_initialized():
            logger.info("Shutting down the local Ray started by RayScheduler")
            ray.shutdown()
        self._started_ray = False
