"""What the three schedulers (``LocalScheduler``, ``RayScheduler``, ``SlurmScheduler``) share.

``SchedulerBase`` holds, once for all three:

- **names and paths**: ``fileroot`` / ``experiment_name`` / ``trial_name`` from the
  arguments or ``exp_config``, the log folder ``{fileroot}/logs/{experiment}/{trial}``,
  the name-resolve key of a worker (``_key``);
- **roles and colocation**: ``self._roles`` (role -> worker records), ``self._aliases``
  (colocated role -> the role that owns the processes), lookup by role or worker id
  (``_workers``, ``_worker``, ``_wait_for_role``), the checks and bookkeeping of a new
  role (``_claim_role``, ``_colocate``) and of a deleted one (``_release_roles``);
- **teardown**: ``close`` (= ``delete_workers()``), context manager, ``atexit`` hook;
- **log tails**: ``read_log_tail`` / ``log_tail_block`` (the last ``LOG_TAIL_LINES``
  lines of a worker's log in every error about it), ``log_path``;
- **liveness**: ``get_workers`` and every RPC (``_rpc`` -> ``call_with_liveness``) raise
  the scheduler's ``_dead_error(record)`` (a ``WorkerDiedError`` naming the worker, with
  its log tail) as soon as the worker is found dead; ``poll_until_healthy`` waits for the
  health endpoints with the same check.

A worker record (each scheduler's own dataclass) has ``worker`` (``Worker``), ``role``,
``index``, ``log_path``, ``client`` (``RPCClient``, None for a command worker) and
optionally ``cmd``. Each scheduler implements ``_dead_error(record, during="")``.

Also here: the environment every worker starts with (``worker_base_env``), the command of
a command worker (``format_command``) and ``set_pdeathsig`` for child processes.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import requests

from areal.api.scheduler_api import Job, Scheduler, WorkerDiedError
from areal.infra.daemon_threads import spawn_daemon
from areal.infra.rpc.client import RPCClient

if TYPE_CHECKING:
    from areal.api.experiment_config import BaseExperimentConfig

LOG_TAIL_LINES = 30
_PR_SET_PDEATHSIG = 1
_REPO_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)


# ---------------------------------------------------------------------------- helpers
def read_log_tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of ``path`` (or a line saying why it could not be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"<could not read {path}: {e}>"


def log_tail_block(path: str, n: int = LOG_TAIL_LINES) -> str:
    """``--- last n lines of PATH ---`` and those lines (for error messages)."""
    return f"--- last {n} lines of {path} ---\n{read_log_tail(path, n)}"


def set_pdeathsig() -> None:
    """In a child between fork and exec: die (SIGKILL) with the parent (Linux, best effort)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - non-glibc systems
        pass


def project_pythonpath() -> str:
    """``PYTHONPATH`` for workers: the current directory, this repository, then ours."""
    parts = [os.getcwd(), _REPO_ROOT]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(dict.fromkeys(parts))


def worker_base_env() -> dict[str, str]:
    """Environment every worker gets on top of its own: import path, unbuffered output,
    one OpenMP thread."""
    return {
        "PYTHONPATH": project_pythonpath(),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }


def format_command(cmd: str | list[str], host: str, ports: list[int]) -> list[str]:
    """Fill ``{host}``/``{port}``/``{portN}`` and replace a leading ``python`` by this interpreter."""
    fmt = {"port": ports[0], "host": host, **{f"port{i}": p for i, p in enumerate(ports)}}
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    argv = [a.format(**fmt) for a in argv]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def call_with_liveness(
    client: RPCClient,
    fn_name: str,
    *args,
    worker_id: str,
    what: str,
    check_dead: Callable[[], BaseException | None],
    timeout: float | None = None,
    check_interval: float = 0.2,
    connection_grace: float = 5.0,
    **kwargs,
) -> Any:
    """Run ``client.<fn_name>`` on a daemon thread; raise ``check_dead()``'s error if the worker dies.

    ``check_dead()`` returns a ``WorkerDiedError`` (worker dead) or None; it is polled
    every ``check_interval`` s and, after a connection error, for ``connection_grace`` s.
    """
    fut = spawn_daemon(
        getattr(client, fn_name), *args, timeout=timeout, name=f"rpc-{worker_id}", **kwargs
    )
    deadline = None if timeout is None else time.monotonic() + timeout + 5.0
    while True:
        if wait_futures([fut], timeout=check_interval).done:
            try:
                return fut.result()
            except requests.ConnectionError as e:
                end = time.monotonic() + connection_grace
                while time.monotonic() < end:
                    err = check_dead()
                    if err is not None:
                        raise err from None
                    time.sleep(0.1)
                raise RuntimeError(
                    f"Worker {worker_id}: {what} failed: connection error {e}"
                ) from e
            except requests.Timeout as e:
                raise TimeoutError(
                    f"Worker {worker_id}: {what} did not finish within {timeout} s"
                ) from e
        err = check_dead()
        if err is not None:
            raise err
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"Worker {worker_id}: {what} did not finish within {timeout} s")


def poll_until_healthy(
    records: Iterable[Any],
    url: Callable[[Any], str],
    dead: Callable[[Any], BaseException | None],
    deadline: float,
    timed_out: Callable[[Any], BaseException],
    interval: float = 0.2,
) -> None:
    """Wait until ``GET url(r)`` answers 200 for every record; raise ``dead(r)`` as soon as
    one is found dead, ``timed_out(r)`` (first one still pending) after ``deadline``
    (``time.monotonic()``)."""
    pending = list(records)
    while pending:
        for r in list(pending):
            err = dead(r)
            if err is not None:
                raise err
            try:
                if requests.get(url(r), timeout=2).status_code == 200:
                    pending.remove(r)
            except requests.RequestException:
                pass
        if pending and time.monotonic() > deadline:
            raise timed_out(pending[0])
        if pending:
            time.sleep(interval)


# ---------------------------------------------------------------------------- base class
class RPCEngineMixin:
    """``create_engine`` / ``call_engine`` / ``set_worker_env`` for schedulers with RPC workers.

    The scheduler provides ``_rpc(worker_id, what, fn_name, *args, timeout=None, **kwargs)``,
    which calls ``RPCClient.<fn_name>`` on the worker and turns a dead worker into a
    ``WorkerDiedError``.
    """

    def _rpc(
        self, worker_id: str, what: str, fn_name: str, *args, timeout: float | None = None, **kwargs
    ) -> Any:
        raise NotImplementedError

    def create_engine(
        self,
        worker_id: str,
        engine: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> None:
        """Instantiate ``engine`` (import path, e.g. ``areal.trainer.ppo.actor.FSDPPPOActor``) in the worker."""
        self._rpc(
            worker_id,
            f"create_engine({engine})",
            "create_engine",
            engine,
            *args,
            engine_name=engine_name,
            timeout=timeout,
            **kwargs,
        )

    def call_engine(
        self,
        worker_id: str,
        method: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> Any:
        """``engine.method(*args, **kwargs)`` in the worker; remote errors raise ``RemoteCallError``."""
        return self._rpc(
            worker_id,
            method,
            "call",
            method,
            *args,
            engine_name=engine_name,
            timeout=timeout,
            **kwargs,
        )

    def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        """Update ``os.environ`` inside an RPC worker (before ``create_engine``)."""
        self._rpc(worker_id, "set_env", "set_env", env)


class SchedulerBase(RPCEngineMixin, Scheduler):
    """Roles, colocation, teardown, log tails and liveness of a scheduler (module doc).

    Subclasses call ``_init_base`` first in ``__init__``, implement ``_dead_error`` and
    ``delete_workers`` (using ``_release_roles``), and set ``call_timeout``.
    """

    #: seconds a connection error is given to turn into a visible death (``_rpc``)
    connection_grace: float = 5.0
    call_timeout: float | None = None

    def _init_base(
        self,
        exp_config: BaseExperimentConfig | None,
        fileroot: str | None,
        experiment_name: str | None,
        trial_name: str | None,
    ) -> None:
        if exp_config is not None:
            fileroot = fileroot or exp_config.cluster.fileroot
            experiment_name = experiment_name or exp_config.experiment_name
            trial_name = trial_name or exp_config.trial_name
        self.fileroot = os.path.abspath(fileroot or os.path.join(tempfile.gettempdir(), "areal"))
        self.experiment_name = experiment_name or "default"
        self.trial_name = trial_name or "trial0"
        self.log_dir = os.path.join(self.fileroot, "logs", self.experiment_name, self.trial_name)
        self._lock = threading.RLock()
        self._roles: dict[str, list[Any]] = {}
        self._aliases: dict[str, str] = {}  # colocated role -> role that owns the processes
        self._closed = False
        atexit.register(SchedulerBase._atexit, weakref.ref(self))

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (``delete_workers()``)."""
        self.delete_workers()
        self._closed = True

    @staticmethod
    def _atexit(ref: weakref.ref) -> None:
        sched = ref()
        if sched is not None and not sched._closed:
            try:
                sched.close()
            except Exception:  # noqa: BLE001 - the interpreter is exiting
                pass

    def _key(self, role: str, index: int) -> str:
        """Name-resolve key of a worker's address."""
        return f"{self.experiment_name}/{self.trial_name}/workers/{role}/{index}"

    # ------------------------------------------------------------------ roles
    def _workers(self, role: str) -> list[Any]:
        with self._lock:
            role = self._aliases.get(role, role)
            if role not in self._roles:
                raise KeyError(
                    f"No workers with role {role!r}; have {sorted(self._roles) + sorted(self._aliases)}"
                )
            return list(self._roles[role])

    def _worker(self, worker_id: str) -> Any:
        role, _, index = worker_id.rpartition("/")
        ws = self._workers(role)
        try:
            return ws[int(index)]
        except (ValueError, IndexError):
            raise KeyError(f"No worker {worker_id!r}") from None

    def _wait_for_role(self, role: str, timeout: float | None) -> list[Any]:
        """The role's worker records, waiting up to ``timeout`` s for the role to appear."""
        deadline = time.monotonic() + (timeout or 0)
        while True:
            try:
                return self._workers(role)
            except KeyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _claim_role(self, role: str) -> None:
        """Raise unless ``role`` is new (neither running nor a colocation alias)."""
        with self._lock:
            if role in self._roles or role in self._aliases:
                raise ValueError(
                    f"Role {role!r} already has workers; delete_workers({role!r}) first"
                )

    def _colocate(self, job: Job) -> list[str] | None:
        """For a ``colocation`` job: make its role an alias of the target role and return
        the target's worker ids; None for any other job."""
        strategy = job.scheduling_strategy
        if strategy is None or strategy.type != "colocation":
            return None
        with self._lock:
            target = strategy.target
            if target not in self._roles:
                raise ValueError(f"Colocation target role {target!r} has no workers")
            if len(self._roles[target]) != job.replicas:
                raise ValueError(
                    f"Colocation needs replicas={len(self._roles[target])} (as {target!r}); got {job.replicas}"
                )
            self._aliases[job.role] = target
            return [w.worker.id for w in self._roles[target]]

    def _release_roles(self, role: str | None) -> list[str]:
        """Bookkeeping of ``delete_workers(role)``: the roles whose workers must be stopped
        (all for None; none when ``role`` is only an alias, which is just dropped), with
        every alias of them dropped. Call with ``self._lock`` held."""
        if role is None:
            self._aliases.clear()
            return list(self._roles)
        if role in self._aliases:
            del self._aliases[role]
            return []
        for alias, target in list(self._aliases.items()):
            if target == role:
                del self._aliases[alias]
        return [role] if role in self._roles else []

    # ------------------------------------------------------------------ liveness
    def _dead_error(self, w: Any, during: str = "") -> WorkerDiedError | None:
        """A ``WorkerDiedError`` naming the worker (with its log tail) if it is dead, else None."""
        raise NotImplementedError

    def _poll_healthy(
        self,
        workers: list[Any],
        health_path: str,
        deadline: float,
        timed_out: Callable[[Any], BaseException],
        dead: Callable[[Any], BaseException | None] | None = None,
        interval: float = 0.2,
    ) -> None:
        """:func:`poll_until_healthy` on the workers' health URLs (``/health`` of an RPC
        worker, ``health_path`` of a command worker); a worker found dead raises
        ``dead(record)`` (default: ``self._dead_error(record, "startup")``)."""
        poll_until_healthy(
            workers,
            url=lambda w: (
                f"http://{w.worker.address}" + ("/health" if w.client is not None else health_path)
            ),
            dead=dead if dead is not None else (lambda w: self._dead_error(w, "startup")),
            deadline=deadline,
            timed_out=timed_out,
            interval=interval,
        )

    def get_workers(self, role: str, timeout: float | None = None) -> list[Any]:
        """Workers of ``role`` (waits up to ``timeout`` s for the role to appear).

        Raises ``WorkerDiedError`` if one of them is dead.
        """
        ws = self._wait_for_role(role, timeout)
        for w in ws:
            err = self._dead_error(w)
            if err is not None:
                raise err
        return [w.worker for w in ws]

    def log_path(self, worker_id: str) -> str:
        return self._worker(worker_id).log_path

    def _rpc(
        self, worker_id: str, what: str, fn_name: str, *args, timeout: float | None = None, **kwargs
    ) -> Any:
        w = self._worker(worker_id)
        if w.client is None:
            cmd = getattr(w, "cmd", None)
            shown = f" ({shlex.join(cmd)})" if cmd else ""
            raise ValueError(f"Worker {worker_id} runs a command{shown}, not an RPC server")
        err = self._dead_error(w, what)
        if err is not None:
            raise err
        return call_with_liveness(
            w.client,
            fn_name,
            *args,
            worker_id=worker_id,
            what=what,
            check_dead=lambda: self._dead_error(w, what),
            timeout=self.call_timeout if timeout is None else timeout,
            connection_grace=self.connection_grace,
            **kwargs,
        )
