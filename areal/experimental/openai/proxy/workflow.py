"""``OpenAIProxyWorkflow``: an agent program as a rollout workflow (AReaL's agent contract).

An *agent* is any object with ``async def run(self, data, **extra_kwargs) -> float |
dict[str, float]``. Each episode:

1. opens a session on the proxy (admin key) and gets a per-session API key;
2. runs the agent: mode ``inline`` awaits ``agent.run(data, base_url=..., api_key=...,
   http_client=...)`` in the rollout event loop (``http_client``: an
   ``httpx.AsyncClient`` for this episode, ready for ``openai.AsyncOpenAI(...,
   http_client=...)``); mode ``subproc`` runs ``asyncio.run(agent.run(data))`` in a
   spawned worker process with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` /
   ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` set (the agent must be picklable);
3. a ``float`` result becomes the reward of the session's last call, a ``dict`` maps
   call ids (completion / response / message ids) to rewards;
4. ends the session (also when the agent raised: the exception then propagates and the
   executor counts the episode as rejected, ``rollout/agent_failed`` records it);
5. exports the interactions with the turn discount applied: ``{id: interaction}``,
   token-exact, which the executor turns into training rows.

Mode ``online`` runs no agent: the episode grants the proxy one external session and
waits for it (started, used and ended by any client through the proxy), then exports
it. The grant is made only once the staleness manager admitted the episode.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import multiprocessing
import numbers
import os
import threading
import weakref
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.proxy.client_session import (
    OpenAIProxyClient,
    ProxyRequestError,
    grant_capacity,
    import_httpx,
    wait_for_session,
)
from areal.experimental.openai.proxy.state import DEFAULT_ADMIN_API_KEY
from areal.infra.rollout import workflow_context
from areal.utils import logging, stats_tracker

logger = logging.getLogger("OpenAIProxyWorkflow")

MODES = ("inline", "subproc", "online")

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool(max_workers: int) -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(
                max_workers=max_workers, mp_context=multiprocessing.get_context("spawn")
            )
            atexit.register(_shutdown_pool)
        return _pool


def _shutdown_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
            _pool = None


def _run_in_subprocess(agent: Any, data: dict[str, Any], envs: dict[str, str]) -> Any:
    os.environ.update(envs)
    import torch

    torch.set_num_threads(1)
    return asyncio.run(agent.run(data))


def _shared_client(timeout: float) -> Any:
    """The episodes' shared HTTP client: the OpenAI SDK's aiohttp-backed ``AsyncClient``.

    It is an ``httpx2.AsyncClient`` (what ``AsyncOpenAI(http_client=...)`` takes) whose
    transport is aiohttp: httpcore's pool probes every idle keep-alive connection's socket
    on each request it adds or removes, which with 64 concurrent episodes cost about a
    third of the rollout loop's CPU.
    """
    from openai import DefaultAioHttpClient

    httpx = import_httpx()

    class SharedAsyncClient(DefaultAioHttpClient):
        """An HTTP client that episodes share: ``aclose`` is a no-op, ``close_shared`` closes."""

        async def aclose(self) -> None:  # agents may close "their" client
            return None

        async def close_shared(self) -> None:
            await super().aclose()

    return SharedAsyncClient(
        timeout=httpx.Timeout(timeout, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
    )


async def _close_at_loop_shutdown(client: Any):
    """Suspended in its loop until ``loop.shutdown_asyncgens()`` (``asyncio.run`` and the
    workflow executor call it before closing the loop), then closes ``client``."""
    try:
        yield
    finally:
        await client.close_shared()


def is_agent(obj: Any) -> bool:
    """True for objects/classes with an ``async def run`` and no ``arun_episode``."""
    if obj is None or isinstance(obj, RolloutWorkflow) or hasattr(obj, "arun_episode"):
        return False
    run = getattr(obj, "run", None)
    return run is not None and inspect.iscoroutinefunction(run)


class OpenAIProxyWorkflow(RolloutWorkflow):
    """Run an agent's ``run()`` as one episode through the proxy (see module docstring)."""

    def __init__(
        self,
        mode: str,
        agent: Any | None = None,
        proxy_addr: str = "",
        admin_api_key: str = DEFAULT_ADMIN_API_KEY,
        discount: float = 1.0,
        export_style: str = "individual",
        subproc_max_workers: int = 4,
        request_timeout: float = 3600.0,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; allowed: {list(MODES)}")
        if not proxy_addr:
            raise ValueError("proxy_addr (the proxy's base URL) is required")
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount={discount}; must be in [0, 1]")
        if export_style not in ("individual", "concat"):
            raise ValueError(f"export_style={export_style!r}; allowed: individual, concat")
        if mode != "online":
            if agent is None:
                raise ValueError(f"mode={mode!r} needs an agent")
            run = getattr(agent, "run", None)
            if run is None or not callable(run):
                raise TypeError(f"agent {type(agent).__name__} has no callable run()")
            if not inspect.iscoroutinefunction(run):
                raise TypeError(f"{type(agent).__name__}.run must be an async function")
        self.mode = mode
        self.agent = agent
        self.proxy_addr = proxy_addr.rstrip("/")
        self._admin_api_key = admin_api_key
        self.discount = float(discount)
        self.export_style = export_style
        self.subproc_max_workers = int(subproc_max_workers)
        self.request_timeout = float(request_timeout)
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def _http(self):
        """One keep-alive HTTP client per event loop, shared by all its episodes.

        Creating an HTTP client costs tens of milliseconds of CPU (TLS context), too much
        per episode. Agents get the shared client as ``http_client``; its ``aclose`` is a
        no-op, so an agent that closes its OpenAI client (``async with
        AsyncOpenAI(http_client=...)``) does not break the other episodes. The client is
        closed when its loop shuts down (an evaluation's ``asyncio.run``, the executor's
        loop), so no connection outlives the loop that opened it.
        """
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None or entry[0].is_closed:
            client = _shared_client(self.request_timeout)
            closer = _close_at_loop_shutdown(client)
            await closer.__anext__()  # now an open async generator of this loop
            entry = self._clients[loop] = (client, closer)
        return entry[0]

    async def _run_agent(self, api_key: str, data: dict[str, Any], http: Any) -> Any:
        if self.mode == "inline":
            return await self.agent.run(
                data, base_url=self.proxy_addr, api_key=api_key, http_client=http
            )
        envs = {
            "OPENAI_BASE_URL": self.proxy_addr,
            "OPENAI_API_KEY": api_key,
            "ANTHROPIC_BASE_URL": self.proxy_addr,
            "ANTHROPIC_API_KEY": api_key,
        }
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            _get_pool(self.subproc_max_workers), _run_in_subprocess, self.agent, data, envs
        )

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        scope = stats_tracker.get(workflow_context.stat_scope())
        task_id = workflow_context.get().task_id
        http = await self._http()
        if self.mode == "online":
            return await self._online_episode(http, scope)
        proxy = OpenAIProxyClient(http, self.proxy_addr, str(task_id), self._admin_api_key)
        try:
            async with proxy:
                rewards = await self._run_agent(proxy.session_api_key, data, http)
                if isinstance(rewards, dict):
                    for cid, r in rewards.items():
                        await proxy.set_reward(cid, float(r))
                elif isinstance(rewards, numbers.Real) and not isinstance(rewards, bool):
                    await proxy.set_last_reward(float(rewards))
                else:
                    raise TypeError(
                        f"agent.run returned {type(rewards).__name__}; expected a float "
                        "(reward of the last call) or a dict {call id: reward}"
                    )
        except Exception as e:
            scope.scalar(agent_failed=1.0)
            logger.warning(
                "agent episode failed (%s: %s); the episode is rejected", type(e).__name__, e
            )
            if proxy.session_id is not None:
                await self._discard(proxy)
            raise
        scope.scalar(agent_failed=0.0)
        interactions = await proxy.export_interactions(self.discount, self.export_style)
        return self._finish(interactions, scope, proxy.session_id)

    async def _discard(self, proxy: OpenAIProxyClient) -> None:
        try:
            await proxy.export_interactions(self.discount, self.export_style)
        except Exception as e:  # the session times out on the server anyway
            logger.warning("could not discard session %s: %s", proxy.session_id, e)

    async def _online_episode(self, http: Any, scope: Any) -> dict[str, Any] | None:
        slot = await grant_capacity(http, self.proxy_addr, self._admin_api_key)
        try:
            session_id = await wait_for_session(http, self.proxy_addr, self._admin_api_key, slot)
        except ProxyRequestError as e:
            if e.status != 503:
                raise
            logger.info("the proxy is stopping: the open online grant is dropped")
            return None
        proxy = OpenAIProxyClient(http, self.proxy_addr, "online", self._admin_api_key)
        proxy.session_id = session_id
        interactions = await proxy.export_interactions(self.discount, self.export_style)
        return self._finish(interactions, scope, session_id)

    @staticmethod
    def _finish(interactions: dict[str, Any], scope: Any, session_id: Any) -> dict | None:
        if not interactions:
            logger.warning("session %s has no interactions; the episode is rejected", session_id)
            return None
        last = interactions[next(reversed(interactions))]
        scope.scalar(reward=float(last.reward or 0.0), n_interactions=float(len(interactions)))
        return interactions
