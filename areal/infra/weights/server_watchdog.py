"""``ServerWatchdog``: replace dead and hung inference servers, in the background.

The trainer calls ``check()`` at step boundaries (before ``prepare_batch`` and right after
a weight update). ``check()`` never waits for a server to start. For every server process
of role ``rollout`` that

- the scheduler reports dead (crash, OOM kill, ``kill -9``), or
- the ``RemoteInfEngine`` declared hung (``hung_addresses``: alive but silent past
  ``rollout.health_check_timeout``, e.g. SIGSTOPped or deadlocked; its process is
  killed with SIGKILL first, so a hung server is *replaced*, not only routed around),

- the engine took out of rotation for another reason (a dropped connection during a
  weight update, a request that failed) while its process lives: a background thread
  probes it for up to ``health_check_timeout`` s; if it answers it is only readmitted with
  the current weights (it may have missed a weight update), else it is treated as hung,

it logs a warning (exit code and log tail for a dead one), takes the address out of the
engine's rotation (its in-flight requests move to the other servers: no sample is lost,
none is generated twice) and starts a background thread that restarts the process
through the scheduler (``restart_worker``: same command, same port if possible) and waits
until it is healthy, while rollout continues on the healthy servers. The process itself
is started from one long-lived spawner thread, so that it still dies with the controller
(``PR_SET_PDEATHSIG`` is tied to the thread that started it).

A restarted server gets traffic only once it holds the current weights:
``WeightSynchronizer.readmit`` loads them and sets the current version under the
synchronizer's lock, so no weight sync can run in between. Where that needs no actor call
(version 0, or ``disk`` mode with the current version's directory on disk) the
background thread readmits it as soon as it is healthy; otherwise (``xccl`` mode: the
actor writes the weights once) the next ``check()`` does, from the training thread. In
``xccl`` mode the synchronizer re-forms the weight-update group with the new member
before the next broadcast (``areal.infra.weight_sync``).

``step_stats()``: ``rollout/server_restarts`` (servers readmitted since the previous call),
``rollout/server_restart_seconds`` (time ``check()`` spent, i.e. what restarts cost the
training loop), ``rollout/server_restart_background_seconds`` (kill to readmission, in the
background), ``rollout/server_restarts_total``, ``rollout/servers_hung_total`` and
``rollout/servers_healthy``.

Slurm (``SlurmScheduler.dead_workers``/``kill_worker``/``restart_worker``): a server whose
job ended or whose node stopped answering slurmctld, or that stayed silent past the health
deadline (a killed node, a cut link), is replaced by a one-task job on a node with room
that is not the lost one. Ray (``RayScheduler.dead_workers``/``kill_worker``/
``restart_worker``): the same, as a new actor pinned to another alive node. Schedulers
without ``dead_workers``/``restart_worker``: servers the engine took out (dead or hung)
stay out of rotation (logged once each); training continues on the others. A server
whose restart failed ``max_restarts`` times in a row is left out as well.
``background=False`` restarts and readmits inside ``check()`` (blocking, as before).

Returning servers: the old address of every server given up (died, hung, its node lost)
is probed from ``check()``, at most every ``probe_interval`` s, in the background (never
while that worker's restart runs: a restart may reuse the address), for
``readmit_window`` s. A server that answers again there (its node came back from a cut
link and the process lived) is readmitted *beside* its replacement, through
``WeightSynchronizer.readmit`` (current weights loaded and version set before it is
marked healthy; the next weight sync's fingerprint check covers it), counted in
``rollout/server_readmits_total`` and logged (``... old process at ADDR answers again N
s after it was given up``). If it leaves the rotation again it is probed again. Schedulers that really kill a given-up server (local,
Ray) leave nothing to readmit; Slurm cannot cancel one task of a job, so the task lives
on unless slurmctld declares its node down (``SlurmdTimeout``).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from areal.api.io_struct import WeightUpdateMeta
from areal.infra.weights.weight_sync import WeightSynchronizer
from areal.utils import logging

logger = logging.getLogger("ServerWatchdog")


class _Spawner:
    """One daemon thread that lives as long as the process and starts the restarted
    servers. ``PR_SET_PDEATHSIG`` fires when the thread that started a child ends, so a
    server started from a short-lived thread would outlive a ``kill -9`` of the
    controller; this thread is flagged ``lives_with_process`` so the scheduler arms it."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="server-spawner", daemon=True)
        self._thread.lives_with_process = True  # read by LocalScheduler._popen
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the spawner thread; wait for and return its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut.result()


class _Restart:
    """One background restart of worker ``wid`` (formerly at ``old``)."""

    def __init__(self, wid: str, old: str | None, why: str):
        self.wid = wid
        self.old = old
        self.why = why
        self.t0 = time.monotonic()
        self.worker: Any = None  # set once the new process is healthy
        self.error: BaseException | None = None
        self.readmitted: tuple[str | None, int] | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None


class _Returning:
    """The old address of a server given up (died, hung, node lost): probed until it
    answers again (its node came back and the process lives) or ``readmit_window`` s."""

    def __init__(self, wid: str, since: float):
        self.wid = wid
        self.since = since
        self.last_probe = 0.0
        self.probe: threading.Thread | None = None
        self.readmitted: tuple[str | None, int] | None = None
        self.answered = False
        self.error: BaseException | None = None
        self.done = threading.Event()


class ServerWatchdog:
    """Detect dead and hung inference servers, restart and readmit them (module docstring)."""

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
        background: bool = True,
        kill_timeout: float = 30.0,
        readmit_window: float = 600.0,
        probe_interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
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
        self.background = background
        self.kill_timeout = kill_timeout
        # a given-up server's old address is probed every probe_interval s for
        # readmit_window s: if it answers it is readmitted beside its replacement
        self.readmit_window = readmit_window
        self.probe_interval = probe_interval
        self._clock = clock
        self._returning: dict[str, _Returning] = {}  # old address -> its probe state
        self._returned: dict[str, str] = {}  # readmitted old address -> worker id
        self.can_restart = callable(getattr(scheduler, "dead_workers", None)) and callable(
            getattr(scheduler, "restart_worker", None)
        )
        self.total_restarts = 0
        self.total_hung = 0
        self.total_readmits = 0  # alive servers put back without a restart
        self._since_stats = 0
        self._seconds = 0.0
        self._bg_seconds = 0.0
        self._lock = threading.Lock()
        self._restarting: dict[str, _Restart] = {}
        self._failures: dict[str, int] = {}
        self._given_up: set[str] = set()
        self._reported_out: set[str] = set()
        self._addr: dict[str, str] = {}
        self._spawner: _Spawner | None = None
        if self.can_restart:
            try:
                self._addr = {w.id: w.address for w in scheduler.get_workers(role)}
            except Exception as e:  # noqa: BLE001 - the watchdog must never stop training
                logger.warning(f"cannot list the {role!r} workers ({e}); restarts disabled")
                self.can_restart = False
        if not self.can_restart:
            logger.info(
                f"{type(scheduler).__name__} cannot restart inference servers: a server that "
                "dies or hangs stays out of rotation and training continues on the others"
            )

    # ------------------------------------------------------------------ checks
    def check(self) -> int:
        """Readmit servers whose restart finished, start restarts of newly dead or hung
        ones; returns how many servers were readmitted by this call (or, by the background
        threads, since the previous call)."""
        if not self.can_restart:
            self._report_out_of_rotation()
            return 0
        t0 = time.monotonic()
        try:
            return self._check()
        finally:
            self._seconds += time.monotonic() - t0

    def _check(self) -> int:
        n = self._collect()
        try:
            dead = list(self.scheduler.dead_workers(self.role))
        except Exception as e:  # noqa: BLE001
            logger.warning(f"dead_workers({self.role!r}) failed: {e}")
            dead = []
        hung_addrs = set(getattr(self.rollout, "hung_addresses", []) or [])
        with self._lock:
            busy = set(self._restarting)
        for wid in dead:
            if wid not in self._given_up and wid not in busy:
                self._start(wid, "died", hung=False)
        healthy = set(self.rollout.healthy_addresses)
        for wid, addr in list(self._addr.items()):
            if wid in self._given_up or wid in busy or wid in dead:
                continue
            if addr in hung_addrs:
                self._start(wid, "hung", hung=True)
            elif addr not in healthy:
                self._start(wid, "out", hung=False)
        for addr, wid in list(self._returned.items()):
            if addr not in healthy:  # out again: back to being probed
                del self._returned[addr]
                self._returning[addr] = _Returning(wid, self._clock())
                logger.warning(
                    f"readmitted inference server {wid} at {addr} left the rotation again; "
                    "probing it for another readmission"
                )
        self._probe_returning()
        if not self.background or not self.rollout.healthy_addresses:
            # nothing to generate with: wait for the restarts (else the step cannot run)
            self.wait_restarts()
        return n + self._collect()

    def _start(self, wid: str, why: str, hung: bool) -> None:
        old = self._addr.get(wid)
        info = ""
        if why == "out":
            logger.warning(
                f"inference server {wid} ({old}) is out of rotation but its process lives; "
                "probing it in the background: readmitted with the current weights if it "
                "answers, replaced if it does not"
            )
        elif hung:
            self.total_hung += 1
            logger.warning(
                f"inference server {wid} ({old}) is hung (no answer within the health "
                "deadline); killing it (SIGKILL) and restarting it in the background"
            )
        else:
            exit_info = getattr(self.scheduler, "worker_exit_info", None)
            if callable(exit_info):
                try:
                    info = "\n" + exit_info(wid)
                except Exception:  # noqa: BLE001
                    info = ""
            logger.warning(
                f"inference server {wid} ({old}) died; restarting it in the background{info}"
            )
        if old is not None and why != "out":
            self.rollout.exclude_server(old, f"its process {why}")
            self._returning.setdefault(old, _Returning(wid, self._clock()))
        r = _Restart(wid, old, why)
        with self._lock:
            self._restarting[wid] = r
        if self.background:
            r.thread = threading.Thread(
                target=self._run_restart, args=(r, hung), name=f"restart-{wid}", daemon=True
            )
            r.thread.start()
        else:
            self._run_restart(r, hung)

    def _kill(self, wid: str) -> None:
        """SIGKILL the process group of a hung worker and wait until the scheduler sees it
        dead; a scheduler whose workers run on other hosts (Slurm) kills it itself
        (``kill_worker``)."""
        role, _, index = wid.rpartition("/")
        kill_worker = getattr(self.scheduler, "kill_worker", None)
        if callable(kill_worker):
            kill_worker(wid)
            pid = None
        else:
            pid = self.scheduler.worker_pids(role)[int(index)]
            try:
                os.killpg(pid, signal.SIGKILL)  # the worker leads its own process group
            except ProcessLookupError:
                pass
            except PermissionError:
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + self.kill_timeout
        while wid not in self.scheduler.dead_workers(self.role):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{wid} (pid {pid}) still alive {self.kill_timeout:.0f} s after SIGKILL"
                )
            time.sleep(0.05)

    def _answers(self, address: str, timeout: float) -> bool:
        """Whether ``address`` answers its health endpoint within ``timeout`` s."""
        import requests

        path = getattr(getattr(self.rollout, "backend", None), "health_path", "/health")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t = max(0.5, min(5.0, deadline - time.monotonic()))
                if requests.get(f"http://{address}{path}", timeout=t).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.2)
        return False

    def _run_restart(self, r: _Restart, hung: bool) -> None:
        try:
            if r.why == "out":
                timeout = float(
                    getattr(getattr(self.rollout, "config", None), "health_check_timeout", 30.0)
                )
                if r.old is not None and self._answers(r.old, timeout):
                    r.worker = types.SimpleNamespace(address=r.old)  # only readmit it
                else:
                    r.why = "out of rotation and silent"
                    hung = True
            if r.worker is None:
                if hung:
                    self._kill(r.wid)
                if self.background:  # started from a thread that lives with the process
                    with self._lock:
                        if self._spawner is None:
                            self._spawner = _Spawner()
                    r.worker = self._spawner.call(lambda: self.scheduler.restart_worker(r.wid))
                else:
                    r.worker = self.scheduler.restart_worker(r.wid)
            if self.background:  # else (or when the actor is needed) _collect readmits it
                r.readmitted = self.weight_sync.readmit(
                    r.worker.address, replaces=self._replaces(r), allow_actor=False
                )
        except BaseException as e:  # noqa: BLE001 - reported by _collect
            r.error = e
        finally:
            r.done.set()

    def _replaces(self, r: _Restart) -> str | None:
        """The address a restarted server takes the place of (not an old server that was
        readmitted meanwhile: that one stays)."""
        return None if r.old in self._returned else r.old

    def wait_restarts(self, timeout: float | None = None) -> None:
        """Block until every restart in progress has finished (or ``timeout`` s passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._restarting.values())
        for r in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            r.done.wait(left)

    # ------------------------------------------------------------------ returning servers
    def _probe_returning(self) -> None:
        """Start a background probe of each given-up address that is due (not while its
        worker's restart runs: a restart may reuse the address); forget addresses given up
        more than ``readmit_window`` s ago (and, in ``_collect``, those a restart reused)."""
        now = self._clock()
        with self._lock:
            busy = {r.wid for r in self._restarting.values()}
        for addr, ret in list(self._returning.items()):
            if now - ret.since > self.readmit_window:
                if ret.probe is None or ret.done.is_set():
                    del self._returning[addr]
                continue
            if (
                ret.wid in busy
                or ret.probe is not None
                or now - ret.last_probe < self.probe_interval
            ):
                continue
            ret.last_probe = now
            ret.probe = threading.Thread(
                target=self._run_probe, args=(addr, ret), name=f"probe-{addr}", daemon=True
            )
            ret.probe.start()
            if not self.background:
                ret.probe.join()

    def _run_probe(self, addr: str, ret: _Returning) -> None:
        try:
            ret.answered = self._answers(addr, timeout=1.0)
            if ret.answered:  # weights first: it gets requests only once it holds them
                ret.readmitted = self.weight_sync.readmit(addr, allow_actor=False)
        except BaseException as e:  # noqa: BLE001 - reported by _collect_returning
            ret.error = e
        finally:
            ret.done.set()

    def _collect_returning(self) -> int:
        """Readmit (on the training thread when the actor must send the weights) the old
        servers that answered again; returns how many were readmitted."""
        n = 0
        for addr, ret in list(self._returning.items()):
            if ret.probe is None or not ret.done.is_set():
                continue
            if ret.answered and ret.error is None and ret.readmitted is None:
                try:
                    ret.readmitted = self.weight_sync.readmit(addr)
                except Exception as e:  # noqa: BLE001
                    ret.error = e
            if not ret.answered or ret.error is not None:
                if ret.error is not None:
                    logger.warning(f"readmission of {ret.wid}'s old server {addr} failed: "
                                   f"{type(ret.error).__name__}: {ret.error}; probing it again")  # fmt: skip
                ret.probe, ret.answered, ret.error = None, False, None
                ret.done.clear()
                continue
            del self._returning[addr]
            self._returned[addr] = ret.wid
            self.total_readmits += 1
            n += 1
            path, version = ret.readmitted
            replacement = self._addr.get(ret.wid)
            logger.warning(
                f"inference server {ret.wid}'s old process at {addr} answers again "
                f"{self._clock() - ret.since:.1f} s after it was given up (its node is back): "
                f"readmitted with weights version {version} ({path or 'initial model'})"
                + (f"; its replacement {replacement} stays" if replacement != addr else "")
            )
        return n

    @property
    def returned(self) -> dict[str, str]:
        """Old server addresses readmitted after their node came back -> worker id."""
        return dict(self._returned)

    def _collect(self) -> int:
        """Readmit (here, on the training thread) restarted servers the background could not
        readmit; account for finished restarts. Returns how many were readmitted."""
        with self._lock:
            finished = [r for r in self._restarting.values() if r.done.is_set()]
        n = self._collect_returning()
        for r in finished:
            if r.error is None and r.readmitted is None:
                try:
                    r.readmitted = self.weight_sync.readmit(
                        r.worker.address, replaces=self._replaces(r)
                    )
                except Exception as e:  # noqa: BLE001
                    r.error = e
            with self._lock:
                self._restarting.pop(r.wid, None)
            if r.error is not None:
                k = self._failures[r.wid] = self._failures.get(r.wid, 0) + 1
                if k >= self.max_restarts:
                    self._given_up.add(r.wid)
                logger.error(
                    f"restart of inference server {r.wid} failed ({k}/{self.max_restarts}): "
                    f"{type(r.error).__name__}: {r.error}; training continues on "
                    f"{self.rollout.healthy_addresses}"
                    + ("; giving up on it" if r.wid in self._given_up else "; retrying next check")
                )
                continue
            self._addr[r.wid] = r.worker.address
            self._returning.pop(r.worker.address, None)  # a restart reused the address
            self._failures.pop(r.wid, None)  # max_restarts counts failures in a row
            path, version = r.readmitted
            n += 1
            if r.why == "out":
                self.total_readmits += 1
                logger.warning(
                    f"inference server {r.wid} answered again and was readmitted at "
                    f"{r.worker.address} with weights version {version} "
                    f"({path or 'initial model'}), without a restart"
                )
                continue
            self.total_restarts += 1
            self._since_stats += 1
            self._bg_seconds += time.monotonic() - r.t0
            logger.warning(
                f"inference server {r.wid} ({r.why}) restarted at {r.worker.address} and "
                f"readmitted with weights version {version} ({path or 'initial model'}) "
                f"{time.monotonic() - r.t0:.1f} s after it was taken out; restarts so far: "
                f"{self.total_restarts}"
            )
        return n

    @property
    def restarting(self) -> list[str]:
        """Worker ids whose restart is in progress."""
        with self._lock:
            return sorted(self._restarting)

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
        """Readmissions (and seconds the training loop spent on restarts) since the
        previous call, totals, and the number of healthy servers."""
        n, self._since_stats = self._since_stats, 0
        seconds, self._seconds = self._seconds, 0.0
        bg, self._bg_seconds = self._bg_seconds, 0.0
        return {
            "rollout/server_restarts": float(n),
            "rollout/server_restart_seconds": seconds,
            "rollout/server_restart_background_seconds": bg,
            "rollout/server_restarts_total": float(self.total_restarts),
            "rollout/servers_hung_total": float(self.total_hung),
            "rollout/server_readmits_total": float(self.total_readmits),
            "rollout/servers_healthy": float(len(self.rollout.healthy_addresses)),
        }
