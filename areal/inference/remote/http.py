"""HTTP plumbing of ``RemoteInfEngine``: sessions, one call, one call to every server.

aiohttp sessions belong to one event loop; the engine keeps one per loop (``_session``),
so it can be used from the WorkflowExecutor's background loop and from a caller's own
loop at once. ``_apost``/``_post`` send one ``HttpCall`` (async / blocking) and raise
``HttpError`` for an answer >= 400; ``_post_idempotent`` retries a call that may arrive
twice once after a dropped connection; ``_call_all`` sends one call to every healthy
server concurrently; ``_apost_in_rotation`` is cancelled as soon as its server leaves the
rotation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from areal.api.inference_protocol import (
    HttpCall,
    HttpError,
    NoHealthyServerError,
    ServerLeftRotationError,
)
from areal.infra.wait_log import fan_out
from areal.utils import logging
from areal.utils.auth import auth_headers, get_run_secret

logger = logging.getLogger("RemoteInfEngine")


class RemoteHttpMixin:
    """HTTP calls of ``RemoteInfEngine`` (module docstring).

    Uses the engine's ``config``, ``backend``, ``_sessions`` (event loop -> aiohttp
    session), ``_lock``, ``_last_ok`` and the rotation (``healthy_addresses``,
    ``_is_healthy``, ``_mark_unhealthy``: ``areal.inference.remote.server_rotation``).
    """

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
        calls = {a: make_call(i, a) for i, a in enumerate(addrs)}
        results: list[Any] = []

        def on_answer(a: str, f: concurrent.futures.Future) -> None:
            try:
                results.append(f.result())
                if responses is not None:
                    responses[a] = results[-1]
            except (requests.ConnectionError, requests.Timeout) as e:
                # a dead or hung server is dropped (the watchdog replaces it), not fatal
                self._mark_unhealthy(a, f"{type(e).__name__}: {e}")

        fan_out(
            lambda a: post(a, calls[a], timeout),
            addrs,
            on_answer,
            logger,
            calls[addrs[0]].path,
            answered=lambda: len(results),
            in_rotation=self._is_healthy,
        )
        if not results:
            raise NoHealthyServerError(f"no inference server of {addrs} answered")
        return results

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
