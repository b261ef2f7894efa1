"""``RemoteInfEngine``: the protocol-agnostic client of one or more inference servers.

Backend differences (endpoint names, payloads, response shapes) live in small adapter
objects (``BackendAdapter``) that the caller passes in: this module knows no server.
The adapters and the engines bound to them (``RemoteLocalEngine``, ``RemotevLLMEngine``,
``RemoteSGLangEngine``) live in ``areal.engine``; ``areal.inference.backends``
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
  With ``return_routed_experts`` (MoE) each chunk also brings the experts every token
  was routed to; ``splice_routing`` keeps, per position, the routing of the chunk that
  generated it (``ModelResponse.routed_experts``, for routing replay in the trainer).
- health deadlines: a background thread probes every server's health endpoint every
  ``health_check_interval`` s. A server that answers neither a probe nor a request for
  ``health_check_timeout`` s (alive but silent: SIGSTOPped, deadlocked, swapping) is
  declared *hung*: taken out of rotation and listed in ``hung_addresses`` (the
  ``ServerWatchdog`` kills and restarts it). Requests waiting on a server that leaves the
  rotation are cancelled and resubmitted elsewhere as prompt + tokens of the chunks
  already completed, so no sample is lost and none is generated twice (the hung
  server's unfinished chunk is discarded).
- weight updates (``remote_weights``: ``update_weights_from_disk``,
  ``init_weights_update_group``, ``update_weights_from_distributed`` return
  ``concurrent.futures.Future``; the servers load under a pending version, which
  ``commit_weights`` makes current and ``rollback_weights`` undoes). None of them pauses
  or sets a version: ``areal.infra.weights.weight_sync.WeightSynchronizer`` does both,
  and skips the pause when ``updates_in_flight(meta)`` (the built-in server stages full
  weights and swaps them in at commit, between two decode steps).
- rollout methods (``submit``/``wait``/``rollout_batch``/``prepare_batch``/``pause``/
  ``resume``) delegate to ``self.workflow_executor`` (``areal.infra.rollout.workflow_executor``).

aiohttp sessions belong to one event loop; the engine keeps one per loop, so it can be
used from the WorkflowExecutor's background loop and from a caller's own loop at once.

Where each part lives (this module assembles them):

- ``areal.api.inference_protocol``: the types shared with the adapters (``GenParams``,
  ``GenChunk``, ``HttpCall``, ``BackendAdapter``, ``stop_reason``, the errors);
- ``areal.inference.remote.http``: HTTP plumbing (sessions, one call, every server);
- ``areal.inference.remote.server_rotation``: health deadlines, choosing a server,
  exclusion and readmission;
- ``areal.inference.remote.server_launch``: starting servers;
- ``areal.inference.remote.weights``: the weight-update RPCs;
- this module: lifecycle, ``agenerate`` (interruptible generation), pause and version,
  rollout delegation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import threading
import time
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import InferenceEngine
from areal.api.inference_protocol import (
    BackendAdapter,
    GenChunk,
    GenParams,
    HttpError,
    ServerLeftRotationError,
)
from areal.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from areal.inference.remote.http import RemoteHttpMixin
from areal.inference.remote.server_launch import ServerLaunchMixin
from areal.inference.remote.server_rotation import ServerRotationMixin
from areal.inference.remote.weights import WeightUpdateRPCMixin
from areal.infra.rollout import workflow_context
from areal.infra.rollout.workflow_executor import WorkflowExecutor
from areal.utils import logging, stats_tracker
from areal.utils.moe_routing import splice_routing

logger = logging.getLogger("RemoteInfEngine")

ENV_SERVER_ADDRS = "AREAL_LLM_SERVER_ADDRS"


class RemoteInfEngine(
    ServerRotationMixin,
    RemoteHttpMixin,
    ServerLaunchMixin,
    WeightUpdateRPCMixin,
    InferenceEngine,
):
    """Client of inference servers speaking ``backend``'s protocol (see module docstring)."""

    def __init__(
        self, config: InferenceEngineConfig | None = None, backend: BackendAdapter | None = None
    ):
        self.config = config if config is not None else InferenceEngineConfig()
        if not isinstance(backend, BackendAdapter):
            raise TypeError(
                f"RemoteInfEngine needs a BackendAdapter (got {backend!r}); use RemoteLocalEngine, "
                "RemotevLLMEngine or RemoteSGLangEngine from areal.engine, or "
                "areal.inference.backends.make_inference_engine(name, config)"
            )
        self.backend = backend
        if self.config.return_routed_experts and backend.name == "vllm":
            raise ValueError(
                "rollout.return_routed_experts=True: vLLM does not return MoE routing; use "
                "the built-in server (local) or SGLang, or set it to False"
            )
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
        interval = float(self.config.health_check_interval)
        if interval > 0:
            self._health_stop.clear()
            self._health_thread = threading.Thread(
                target=self._health_loop, args=(interval,), name="server-health", daemon=True
            )
            self._health_thread.start()
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

    def export_stats(self) -> dict[str, float]:
        """Rollout statistics recorded since the last export (``stats_tracker``)."""
        return stats_tracker.export_all()

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
        # gconfig.seed (AReaL 2.0) is sent as it is; else the request's derived seed
        seed = g.seed if g.seed is not None else req.metadata.get("seed")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routed = None  # expert ids per token run so far (return_routed_experts)
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
                    return_routed_experts=self.config.return_routed_experts,
                    # training requests of a deterministic run are computed alone
                    deterministic=self.config.deterministic and not workflow_context.get().is_eval,
                )
                version_before = self._version
                if req.image_data:  # vision-language request
                    chunk = await self._generate_chunk(
                        req.rid,
                        list(req.input_ids) + tokens,
                        p,
                        req.image_data,
                        req.vision_msg_vllm,
                    )
                else:
                    chunk = await self._generate_chunk(req.rid, list(req.input_ids) + tokens, p)
                if chunk.tokens and ttft == float("inf"):
                    ttft = time.perf_counter() - start
                if p.return_routed_experts:
                    routed = splice_routing(
                        routed, chunk.routed_experts, len(req.input_ids) + len(tokens), req.rid
                    )
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
            routed_experts=routed,
        )

    # ------------------------------------------------------------------ pause / version
    def updates_in_flight(self, meta: WeightUpdateMeta) -> bool:
        """Whether the weight update ``meta`` can go on while the servers generate
        (``config.inflight_weight_updates`` and a server that stages it: the built-in
        one, full weights); else ``WeightSynchronizer`` pauses generation around it."""
        return bool(self.config.inflight_weight_updates) and self.backend.updates_in_flight(meta)

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

    def set_cpu_threads(self, threads: int) -> bool:
        """Every server's torch CPU threads from its next step (the built-in server);
        False where the backend's threads are fixed at launch (vLLM, SGLang)."""
        if self.backend.cpu_threads_call(threads) is None or not self.healthy_addresses:
            return False
        self._call_all(lambda i, a: self.backend.cpu_threads_call(threads), idempotent=True)
        return True

    def set_version(self, version: int) -> None:
        # Servers first: a rollout started under the new version (the executor reads
        # get_version()) must not get tokens the servers still label with the old one.
        version = int(version)
        if self.backend.set_version_call(version) is not None and self.healthy_addresses:
            self._call_all(lambda i, a: self.backend.set_version_call(version), idempotent=True)
        self._version = version

    def get_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ rollout delegation
    def _executor_or_raise(self):
        if self.workflow_executor is None:
            raise RuntimeError("no WorkflowExecutor: call initialize() first")
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
        reward_normalization=False,
        drop_incomplete_group=False,
    ) -> int:
        return self._executor_or_raise().submit(
            data,
            workflow,
            workflow_kwargs,
            should_accept_fn,
            group_size,
            task_id,
            is_eval,
            reward_normalization=reward_normalization,
            drop_incomplete_group=drop_incomplete_group,
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
