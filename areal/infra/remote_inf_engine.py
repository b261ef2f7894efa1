"""``RemoteInfEngine``: the protocol-agnostic client of one or more inference servers.

Backend differences (endpoint names, payloads, response shapes) live in small adapter
objects (``BackendAdapter``) that the caller passes in: this module knows no server.
The adapters and the engines bound to them (``RemoteLocalEngine``, ``RemotevLLMEngine``,
``RemoteSGLangEngine``) live in ``areal.engine``; ``areal.engine.inference_backends``
maps a backend name to them and to its server command.

What the engine does on top of the adapters:

- ``agenerate``: picks a server (the rid's server if it has one, else the healthy server
  with the fewest requests in flight), retries 5xx answers and timeouts
  ``request_retries`` times with exponential backoff (a dropped connection to a server
  that still answers its health probe is retried for up to ``request_timeout`` s without
  using them up), marks a server that stops answering unhealthy and moves its requests
  to the others, and makes generation *interruptible*: a chunk that comes back with stop reason
  ``abort`` (a pause for a weight update) is resubmitted after ``continue_generation``
  as prompt + tokens so far, with ``max_new_tokens`` reduced; tokens, logprobs and
  per-token versions are concatenated, so one response may span several weight versions.
- health deadlines: a background thread probes every server's health endpoint every
  ``health_check_interval`` s. A server that answers neither a probe nor a request for
  ``health_check_timeout`` s (alive but silent: SIGSTOPped, deadlocked, swapping) is
  declared *hung*: taken out of rotation and listed in ``hung_addresses`` (the
  ``ServerWatchdog`` kills and restarts it). Requests waiting on a server that leaves the
  rotation are cancelled and resubmitted elsewhere as prompt + tokens of the chunks
  already completed, so no sample is lost and none is generated twice (the hung
  server's unfinished chunk is discarded).
- weight updates (``update_weights_from_disk``, ``init_weights_update_group``,
  ``update_weights_from_distributed``) return ``concurrent.futures.Future``; when the
  engine is not already paused they pause every server, update, set the version and
  continue. For a multi-bucket distributed update call ``pause_generation()`` first and
  ``continue_generation()`` after the last bucket (the engine then leaves pausing alone).
- rollout methods (``submit``/``wait``/``rollout_batch``/``prepare_batch``/``pause``/
  ``resume``) delegate to ``self.workflow_executor`` (``areal.infra.workflow_executor``).

aiohttp sessions belong to one event loop; the engine keeps one per loop, so it can be
used from the WorkflowExecutor's background loop and from a caller's own loop at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import random
import shlex
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import ModelRequest, ModelResponse, ParamSpec, WeightUpdateMeta
from areal.infra.wait_log import WaitLog
from areal.utils import logging
from areal.utils.auth import auth_headers, get_run_secret

logger = logging.getLogger("RemoteInfEngine")

ENV_SERVER_ADDRS = "AREAL_LLM_SERVER_ADDRS"


# =====================================================================================
# Backend adapters
# =====================================================================================


@dataclasses.dataclass
class GenParams:
    """Sampling parameters of one chunk of a request."""

    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    greedy: bool
    stop_token_ids: list[int]
    ignore_eos: bool
    seed: int | None = None  # per-request sampling seed (reproducible sampling)


@dataclasses.dataclass
class GenChunk:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int] | None  # None: the backend does not report versions
    stop_reason: str  # "stop" | "length" | "abort"


@dataclasses.dataclass
class HttpCall:
    path: str
    payload: dict[str, Any] | None = None
    method: str = "POST"


class BackendAdapter:
    """Maps engine operations to one server protocol. Subclasses fill in the payloads."""

    name = "base"
    health_path = "/health"
    reports_versions = False

    def generate_call(self, rid: str, input_ids: list[int], p: GenParams) -> HttpCall:
        raise NotImplementedError

    def parse_generate(self, data: dict[str, Any]) -> GenChunk:
        raise NotImplementedError

    def with_images(
        self, call: HttpCall, image_data: list[Any], messages: list[dict] | None
    ) -> HttpCall:
        """The generate call of a request with images (see ``areal.infra.vision_requests``)."""
        from areal.infra.vision_requests import add_images

        return add_images(self.name, call, image_data, messages)

    def pause_call(self) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} cannot pause generation")

    def resume_call(self) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} cannot resume generation")

    def update_disk_call(self, path: str, version: int | None) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} cannot reload weights from disk")

    def init_group_call(self, meta: WeightUpdateMeta, rank: int, world_size: int) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} has no distributed weight update")

    def update_distributed_call(
        self, meta: WeightUpdateMeta, specs: list[ParamSpec], version: int | None
    ) -> HttpCall:
        raise NotImplementedError(f"backend {self.name!r} has no distributed weight update")

    def set_version_call(self, version: int) -> HttpCall | None:
        """None: the server does not track versions (the client does)."""
        return None


def _stop_reason(x: Any) -> str:
    if isinstance(x, dict):
        x = x.get("type")
    if x in ("stop", "length", "abort"):
        return x
    return "abort" if x in (None, "cancelled", "interrupt") else "stop"


class HttpError(RuntimeError):
    def __init__(self, status: int, message: str, address: str):
        super().__init__(f"HTTP {status} from {address}: {message}")
        self.status = status


class NoHealthyServerError(RuntimeError):
    pass


class ServerLeftRotationError(ConnectionError):
    """The server of an in-flight request was taken out of rotation (hung or dead)."""


# =====================================================================================
# Engine
# =====================================================================================


class RemoteInfEngine(InferenceEngine):
    """Client of inference servers speaking ``backend``'s protocol (see module docstring)."""

    def __init__(
        self, config: InferenceEngineConfig | None = None, backend: BackendAdapter | None = None
    ):
        self.config = config if config is not None else InferenceEngineConfig()
        if not isinstance(backend, BackendAdapter):
            raise TypeError(
                f"RemoteInfEngine needs a BackendAdapter (got {backend!r}); use RemoteLocalEngine, "
                "RemotevLLMEngine or RemoteSGLangEngine from areal.engine, or "
                "areal.engine.inference_backends.make_inference_engine(name, config)"
            )
        self.backend = backend
        self.addresses: list[str] = []
        self.workflow_executor = None
        self._healthy: dict[str, bool] = {}
        self._inflight: dict[str, int] = {}
        self._rid_server: dict[str, str] = {}
        self._lock = threading.Lock()
        self._paused = threading.Event()
        self._version = 0
        self._sessions: dict[asyncio.AbstractEventLoop, Any] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._launched: list[Any] = []
        self._initialized = False
        # health deadlines (module docstring)
        self._last_ok: dict[str, float] = {}
        self._hung: set[str] = set()
        #: requests moved off a server that left the rotation while they waited on it
        self.requests_moved = 0
        #: the last disk weight update's answers by server address (e.g. the fingerprint a
        #: built-in server returns with it: areal.infra.weight_verify)
        self.disk_update_responses: dict[str, Any] = {}
        self._health_stop = threading.Event()
        self._health_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def initialize(
        self,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
        **kwargs,
    ) -> None:
        if isinstance(addr, str):
            addrs = [a.strip() for a in addr.split(",") if a.strip()]
        elif addr:
            addrs = list(addr)
        elif os.environ.get(ENV_SERVER_ADDRS):
            addrs = [a.strip() for a in os.environ[ENV_SERVER_ADDRS].split(",") if a.strip()]
        else:
            addrs = [s.address for g in self._launched for s in getattr(g, "servers", [g])]
        if not addrs:
            raise ValueError(
                f"no inference server addresses: pass addr='host:port[,host:port]', set "
                f"{ENV_SERVER_ADDRS}, or call launch_server() first"
            )
        for a in addrs:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bad server address {a!r}; expected 'host:port'")
        self.addresses = addrs
        self._healthy = dict.fromkeys(addrs, True)
        self._inflight = dict.fromkeys(addrs, 0)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="remote-inf-engine"
        )
        self._wait_healthy(addrs, self.config.setup_timeout)
        self._last_ok = dict.fromkeys(addrs, time.monotonic())
        self._hung = set()
        self._initialized = True
        interval = float(getattr(self.config, "health_check_interval", 0) or 0)
        if interval > 0:
            self._health_stop.clear()
            self._health_thread = threading.Thread(
                target=self._health_loop, args=(interval,), name="server-health", daemon=True
            )
            self._health_thread.start()
        try:
            from areal.infra.workflow_executor import WorkflowExecutor
        except ImportError as e:  # rollout methods unavailable; agenerate still works
            logger.warning("WorkflowExecutor unavailable (%s); rollout methods disabled", e)
        else:
            self.workflow_executor = WorkflowExecutor(self.config, inference_engine=self)
            self.workflow_executor.initialize(train_data_parallel_size=train_data_parallel_size)
        logger.info("connected to %d %s server(s): %s", len(addrs), self.backend.name, addrs)

    def destroy(self) -> None:
        self._health_stop.set()
        if self._health_thread is not None:
            self._health_thread.join(timeout=10)
            self._health_thread = None
        if self.workflow_executor is not None:
            try:
                self.workflow_executor.destroy()
            finally:
                self.workflow_executor = None
        for loop, session in list(self._sessions.items()):
            try:
                if loop.is_closed():
                    conn = session.connector
                    session.detach()
                    if conn is not None:
                        conn._close()
                elif loop.is_running():
                    asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)
                else:
                    loop.run_until_complete(session.close())
            except Exception as e:
                logger.debug("closing an HTTP session failed: %s", e)
        self._sessions.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._initialized = False

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

    # ------------------------------------------------------------------ backend hooks
    @classmethod
    def as_controller(cls, config: InferenceEngineConfig, scheduler: Any) -> Any:
        """A ``RolloutController`` that starts this engine's servers through ``scheduler``
        and drives them from the calling process (``submit``/``wait``/``export_stats``)."""
        from areal.infra.controller.rollout_controller import RolloutController

        return RolloutController(cls, config=config, scheduler=scheduler)

    @classmethod
    def build_server_command(cls, server_args: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """Command line of one server of this engine's backend, as a shell-quoted string
        with ``{host}``/``{port}`` placeholders (literal braces doubled, as schedulers
        ``str.format`` each argument), and the extra environment it needs.
        ``server_args`` maps flag names to values."""
        raise NotImplementedError(f"{cls.__name__} cannot start servers")

    def launch_server(self, server_args: dict[str, Any]) -> list[str]:
        """Start one server process on this machine (``server_args``: flags, plus optional
        ``host``/``port``); returns its addresses. Stopped by ``teardown_server``."""
        from areal.infra.launcher.server_process import launch_server_process
        from areal.utils.network import find_free_ports

        args = dict(server_args)
        host = args.pop("host", "127.0.0.1")
        port = args.pop("port", None) or find_free_ports(1)[0]
        cmd_str, env = self.build_server_command(args)
        cmd = [c.format(host=host, port=port) for c in shlex.split(cmd_str)]
        if cmd and cmd[0] in ("python", "python3"):
            cmd[0] = sys.executable
        sp = launch_server_process(
            cmd,
            f"{host}:{port}",
            health_path=self.backend.health_path,
            timeout=self.config.setup_timeout,
            env=env,
        )
        self._launched.append(sp)
        return [sp.address]

    def teardown_server(self) -> None:
        while self._launched:
            launched = self._launched.pop()
            stop = getattr(launched, "shutdown", None) or launched.stop
            stop()

    def export_stats(self) -> dict[str, float]:
        """Rollout statistics recorded since the last export (``stats_tracker``)."""
        from areal.utils import stats_tracker

        return stats_tracker.export_all()

    # ------------------------------------------------------------------ HTTP plumbing
    def _session(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        s = self._sessions.get(loop)
        if s is None or s.closed:
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
            self._sessions[loop] = s
            for old in [lp for lp in self._sessions if lp.is_closed()]:
                sess = self._sessions.pop(old)
                conn = sess.connector
                sess.detach()
                if conn is not None:
                    conn._close()
        return s

    async def _apost(self, addr: str, call: HttpCall, timeout: float) -> dict[str, Any]:
        import aiohttp

        session = self._session()
        async with session.request(
            call.method,
            f"http://{addr}{call.path}",
            json=call.payload,
            headers=auth_headers(get_run_secret()),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            if resp.status >= 400:
                text = await resp.text()
                raise HttpError(resp.status, text[:2000], addr)
            return await resp.json(content_type=None)

    def _post(self, addr: str, call: HttpCall, timeout: float | None = None) -> dict[str, Any]:
        import requests

        r = requests.request(
            call.method,
            f"http://{addr}{call.path}",
            json=call.payload,
            headers=auth_headers(get_run_secret()),
            timeout=timeout or self.config.request_timeout,
        )
        if r.status_code >= 400:
            raise HttpError(r.status_code, r.text[:2000], addr)
        return r.json() if r.content else {}

    def _post_idempotent(
        self, addr: str, call: HttpCall, timeout: float | None = None
    ) -> dict[str, Any]:
        """``_post`` of a call that may safely arrive twice (pause, continue, set version,
        reload from disk): a dropped connection to a server that still answers its health
        probe is retried once instead of taking the server out of the rotation."""
        import requests

        try:
            return self._post(addr, call, timeout)
        except requests.ConnectionError as e:
            try:
                self._post(addr, HttpCall(self.backend.health_path, None, "GET"), 5.0)
            except Exception:  # noqa: BLE001 - no answer: the original error stands
                raise e from None
            logger.warning("%s %s: connection dropped (%s); retrying once", addr, call.path, e)
            return self._post(addr, call, timeout)

    def _call_all(
        self,
        make_call: Callable[[int, str], HttpCall],
        timeout: float | None = None,
        idempotent: bool = False,
        responses: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Send one call to every healthy server concurrently; raise the first error.

        ``idempotent``: the call may arrive twice, so a dropped connection to a server
        that still answers its health probe is retried once (``_post_idempotent``).
        ``responses``: also filled with each answer by server address."""
        addrs = self.healthy_addresses
        if not addrs:
            raise NoHealthyServerError("no healthy inference server left")
        import requests

        post = self._post_idempotent if idempotent else self._post
        results: list[Any] = []
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(addrs))
        try:
            futs = {pool.submit(post, a, make_call(i, a), timeout): a for i, a in enumerate(addrs)}
            pending = set(futs)
            futs_path = make_call(0, addrs[0]).path
            wait_log = WaitLog(logger)
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=0.5)
                for f in done:
                    a = futs[f]
                    try:
                        results.append(f.result())
                        if responses is not None:
                            responses[a] = results[-1]
                    except (requests.ConnectionError, requests.Timeout) as e:
                        # a dead or hung server is dropped (the watchdog replaces it), not fatal
                        self._mark_unhealthy(a, f"{type(e).__name__}: {e}")
                for f in [f for f in pending if not self._is_healthy(futs[f])]:
                    # declared hung/dead meanwhile (health deadline): do not wait for it
                    pending.discard(f)
                    logger.warning("not waiting for %s any more: it left the rotation", futs[f])
                wait_log.tick(
                    lambda pending=pending: (
                        f"{sorted(futs[f] for f in pending)} to answer {futs_path} "
                        f"({len(results)} of {len(addrs)} answered)"
                    )
                )
        finally:
            pool.shutdown(wait=False)
        if not results:
            raise NoHealthyServerError(f"no inference server of {addrs} answered")
        return results

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

        def probe(a: str) -> None:
            try:
                r = requests.get(f"http://{a}{self.backend.health_path}", timeout=probe_timeout)
                if r.status_code == 200:
                    with self._lock:
                        self._last_ok[a] = time.monotonic()
            except requests.RequestException:
                pass

        try:
            while not self._health_stop.wait(interval):
                addrs = self.healthy_addresses
                futs = [pool.submit(probe, a) for a in addrs]
                concurrent.futures.wait(futs, timeout=probe_timeout + 1)
                now = time.monotonic()
                for a in addrs:
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

    async def _probe(self, addr: str) -> bool:
        try:
            await self._apost(addr, HttpCall(self.backend.health_path, None, "GET"), timeout=5.0)
            return True
        except Exception:
            return False

    async def _apost_in_rotation(self, addr: str, call: HttpCall, timeout: float) -> dict[str, Any]:
        """``_apost``, cancelled (``ServerLeftRotationError``) as soon as ``addr`` leaves the
        rotation (health deadline, a failure seen by another request, a restart)."""
        task = asyncio.ensure_future(self._apost(addr, call, timeout))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    result = task.result()
                    with self._lock:
                        self._last_ok[addr] = time.monotonic()
                    return result
                if not self._is_healthy(addr):
                    raise ServerLeftRotationError(f"{addr} left the rotation")
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - its result is discarded either way
                    pass

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

    # ------------------------------------------------------------------ generation
    async def _generate_chunk(
        self,
        rid: str,
        input_ids: list[int],
        p: GenParams,
        image_data: list[Any] | None = None,
        messages: list[dict] | None = None,
    ) -> GenChunk:
        import aiohttp

        call = self.backend.generate_call(rid, input_ids, p)
        if image_data:
            call = self.backend.with_images(call, image_data, messages)

        retries = self.config.request_retries
        last: Exception | None = None
        failures = 0  # 5xx answers and timeouts: bounded by request_retries
        tries = 0
        start = time.monotonic()
        while True:
            addr = self._choose_server(rid)
            tries += 1
            with self._lock:
                self._inflight[addr] += 1
            try:
                data = await self._apost_in_rotation(addr, call, self.config.request_timeout)
                return self.backend.parse_generate(data)
            except HttpError as e:
                if e.status < 500:
                    raise ValueError(str(e)) from e
                last = e
                failures += 1
            except ServerLeftRotationError as e:
                # not a failure of the request: it moves (its unfinished chunk is dropped)
                last = e
                with self._lock:
                    self.requests_moved += 1
                logger.warning("request %s moves off %s: %s", rid, addr, e)
                continue
            except TimeoutError as e:  # before OSError: TimeoutError is one
                last = e
                failures += 1
                if not await self._probe(addr):
                    self._mark_unhealthy(addr, f"{type(e).__name__}: {e}")
            except (aiohttp.ClientError, OSError) as e:
                # A broken connection: if the server still answers its health probe (a
                # dropped connection, a proxy restart) the request is retried without
                # using up request_retries, for up to request_timeout seconds in all;
                # else the server leaves the rotation and the request moves.
                last = e
                if not await self._probe(addr):
                    self._mark_unhealthy(addr, f"{type(e).__name__}: {e}")
                elif time.monotonic() - start > self.config.request_timeout:
                    failures = retries + 1
            finally:
                with self._lock:
                    self._inflight[addr] -= 1
            if failures > retries:
                break
            delay = min(0.2 * 2 ** min(tries - 1, 5), 5.0) * (0.5 + random.random())
            logger.info(
                "request %s failed on %s (%s); retry %d in %.2fs", rid, addr, last, tries, delay
            )
            await asyncio.sleep(delay)
        raise RuntimeError(
            f"request {rid} failed after {tries} attempts ({failures} 5xx/timeouts, "
            f"{time.monotonic() - start:.0f} s): {last}"
        ) from last

    async def _wait_resumed(self) -> None:
        while self._paused.is_set():
            await asyncio.sleep(0.02)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if not self._initialized:
            raise RuntimeError("RemoteInfEngine.initialize() was not called")
        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError(
                f"agenerate takes gconfig.n_samples=1 (got {g.n_samples}); send n requests"
            )
        max_new = min(g.max_new_tokens, g.max_tokens - len(req.input_ids))
        if max_new < 1:
            raise ValueError(
                f"prompt of {len(req.input_ids)} tokens leaves no room under gconfig.max_tokens={g.max_tokens}"
            )
        seed = req.metadata.get("seed")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        stop_reason = "abort"
        start = time.perf_counter()
        ttft = float("inf")
        try:
            while len(tokens) < max_new:
                await self._wait_resumed()
                p = GenParams(
                    max_new_tokens=max_new - len(tokens),
                    min_new_tokens=max(0, min(g.min_new_tokens, max_new) - len(tokens)),
                    temperature=g.temperature,
                    top_p=g.top_p,
                    top_k=g.top_k,
                    greedy=g.greedy,
                    stop_token_ids=list(g.stop_token_ids),
                    ignore_eos=g.ignore_eos,
                    # A resumed chunk continues the same seeded stream deterministically.
                    seed=None if seed is None else seed + len(tokens),
                )
                version_before = self._version
                if req.image_data:  # vision-language request
                    chunk = await self._generate_chunk(
                        req.rid,
                        list(req.input_ids) + tokens,
                        p,
                        req.image_data,
                        getattr(req, "vision_msg_vllm", None),
                    )
                else:
                    chunk = await self._generate_chunk(req.rid, list(req.input_ids) + tokens, p)
                if chunk.tokens and ttft == float("inf"):
                    ttft = time.perf_counter() - start
                tokens += chunk.tokens
                logprobs += chunk.logprobs
                versions += (
                    chunk.versions
                    if chunk.versions is not None
                    else [version_before] * len(chunk.tokens)
                )
                stop_reason = chunk.stop_reason
                if stop_reason != "abort":
                    break
                if self.config.enable_rollout_tracing:
                    logger.info(
                        "request %s interrupted after %d tokens; resuming", req.rid, len(tokens)
                    )
                if not chunk.tokens:
                    await asyncio.sleep(0.05)
        finally:
            with self._lock:
                self._rid_server.pop(req.rid, None)
        if stop_reason == "abort" and len(tokens) >= max_new:
            stop_reason = "length"
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop_reason,
            latency=time.perf_counter() - start,
            ttft=ttft,
            tokenizer=req.tokenizer,
            metadata=dict(req.metadata),
        )

    # ------------------------------------------------------------------ pause / version
    def pause_generation(self) -> None:
        """Interrupt in-flight generation everywhere; new chunks wait for ``continue_generation``."""
        self._paused.set()
        self._call_all(lambda i, a: self.backend.pause_call(), idempotent=True)
        if self.config.pause_grace_period > 0:
            time.sleep(self.config.pause_grace_period)

    def continue_generation(self) -> None:
        self._call_all(lambda i, a: self.backend.resume_call(), idempotent=True)
        self._paused.clear()

    def is_paused(self) -> bool:
        return self._paused.is_set()

    def set_version(self, version: int) -> None:
        # Servers first: a rollout started under the new version (the executor reads
        # get_version()) must not get tokens the servers still label with the old one.
        version = int(version)
        if self.backend.set_version_call(version) is not None and self.healthy_addresses:
            self._call_all(lambda i, a: self.backend.set_version_call(version), idempotent=True)
        self._version = version

    def get_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ weights
    def _submit(self, fn: Callable[[], Any]) -> Future:
        if self._executor is None:
            raise RuntimeError("RemoteInfEngine.initialize() was not called")
        return self._executor.submit(fn)

    def _paused_update(self, update: Callable[[], Any], version: int | None) -> Any:
        own_pause = not self._paused.is_set()
        if own_pause:
            self.pause_generation()
        try:
            result = update()
            if version is not None:
                self.set_version(version)
            return result
        finally:
            if own_pause:
                self.continue_generation()

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        if meta.type != "disk" or not meta.path:
            raise ValueError(
                "update_weights_from_disk needs a WeightUpdateMeta of type 'disk' with a path"
            )

        def _run():
            t0 = time.monotonic()
            # each server's answer, e.g. its weight fingerprint (areal.infra.weight_verify)
            self.disk_update_responses = responses = {}
            self._paused_update(
                lambda: self._call_all(
                    lambda i, a: self.backend.update_disk_call(meta.path, meta.version),
                    idempotent=True,
                    responses=responses,
                ),
                meta.version,
            )
            logger.info(
                "weights reloaded from %s (version %s) in %.2fs",
                meta.path,
                meta.version,
                time.monotonic() - t0,
            )

        return self._submit(_run)

    def _weight_update_http_timeout(self, meta: WeightUpdateMeta) -> float:
        # The server answers within ``meta.timeout_s`` (its join / broadcasts fail then):
        # wait a little longer so its error, not a client timeout, is what gets raised.
        return max(float(self.config.request_timeout), float(meta.timeout_s) + 15.0)

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future:
        """Make every server join the ``xccl`` group as ranks 1..n (sets ``meta.world_size``).

        The join is a rendezvous: the returned Future completes only once training rank 0
        joins too (within ``meta.timeout_s``), so start it *before* rank 0 joins and wait
        for both.
        """
        addrs = self.healthy_addresses
        world_size = 1 + len(addrs)
        if meta.world_size and meta.world_size != world_size:
            raise ValueError(
                f"meta.world_size={meta.world_size}, but 1 trainer + {len(addrs)} servers = {world_size}"
            )
        meta.world_size = world_size
        timeout = self._weight_update_http_timeout(meta)

        def _run():
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(addrs)) as pool:
                futs = [
                    pool.submit(
                        self._post,
                        a,
                        self.backend.init_group_call(meta, 1 + i, world_size),
                        timeout,
                    )
                    for i, a in enumerate(addrs)
                ]
                return [f.result() for f in futs]

        return self._submit(_run)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> Future:
        """Announce one bucket; the Future completes when every server has received it."""
        specs = list(param_specs)
        timeout = self._weight_update_http_timeout(meta)

        def _run():
            return self._paused_update(
                lambda: self._call_all(
                    lambda i, a: self.backend.update_distributed_call(meta, specs, meta.version),
                    timeout,
                ),
                meta.version,
            )

        return self._submit(_run)

    # ------------------------------------------------------------------ rollout delegation
    def _executor_or_raise(self):
        if self.workflow_executor is None:
            raise RuntimeError(
                "no WorkflowExecutor: call initialize() first (and check areal.infra.workflow_executor imports)"
            )
        return self.workflow_executor

    @property
    def staleness_manager(self):
        return self._executor_or_raise().staleness_manager

    def submit(
        self,
        data,
        workflow=None,
        workflow_kwargs=None,
        should_accept_fn=None,
        group_size=1,
        task_id=None,
        is_eval=False,
    ) -> int:
        return self._executor_or_raise().submit(
            data, workflow, workflow_kwargs, should_accept_fn, group_size, task_id, is_eval
        )

    def wait(self, count: int, timeout: float | None = None, **kwargs):
        return self._executor_or_raise().wait(count, timeout=timeout, **kwargs)

    def rollout_batch(self, data, workflow=None, workflow_kwargs=None, **kwargs):
        return self._executor_or_raise().rollout_batch(data, workflow, workflow_kwargs, **kwargs)

    def prepare_batch(self, dataloader, workflow=None, workflow_kwargs=None, **kwargs):
        return self._executor_or_raise().prepare_batch(
            dataloader, workflow, workflow_kwargs, **kwargs
        )

    def pause(self) -> None:
        self._executor_or_raise().pause()

    def resume(self) -> None:
        self._executor_or_raise().resume()
