"""The gateway's aiohttp app: check the key, pick the proxy worker, forward, record.

For every request, in order:

1. ``/health`` (no key) and ``/gateway/stats`` (admin key) are the gateway's own;
2. the key is checked with the gateway's ``KeyRing`` (:mod:`areal.utils.auth`): the
   admin key on the proxy's admin paths (``/rl/start_session``, ``/export_trajectories``,
   ``/grant_capacity``, ``/internal/wait_for_session``), a live session key on every other
   path; a rejected request is answered 401 before its body is read;
3. the worker is chosen (``routing.Router``): a new session goes to the least-loaded live
   worker (a refresh, i.e. a start with a live session's key, to that session's worker);
   a session call, export or grant wait to the worker that holds it;
4. the request is forwarded unchanged (path, body, key headers); a streamed (SSE)
   answer is forwarded as a stream, any other answer as it came;
5. the answer updates the routes: a started session is bound to its worker, an ended one
   stops counting as load, an exported one is forgotten.

A worker that cannot be reached (connection refused or dropped, a stream cut off) is
probed once; if its health check fails too it is marked dead: its sessions not yet
exported (open, or ended and awaiting export) fail with the reason, and each of their
calls (the one in flight and every later one) is answered 502 ``proxy_worker_failed``
naming the worker and the reason, counted in ``/gateway/stats``. A new session that
hits a dead worker is retried on another one. A background task probes every worker's
``/health`` each ``health_interval`` seconds and takes out (or puts back) workers that
stop (or start again) answering.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from areal.experimental.openai.proxy.gateway.routing import NoLiveWorker, ProxyWorker, Route, Router
from areal.utils import auth, logging

logger = logging.getLogger("ProxyGateway")

ADMIN_PATHS = frozenset(
    {"/rl/start_session", "/export_trajectories", "/grant_capacity", "/internal/wait_for_session"}
)
_FORWARD_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "anthropic-version")
_ROUTER_KEY = web.AppKey("router", Router)
_FAILED = "proxy_worker_failed"


class WorkerUnreachable(Exception):
    """Forwarding to a worker failed at the connection level (reason in ``args[0]``)."""


def _normalize(path: str) -> str:
    """The proxy path without its optional ``/v1`` prefix."""
    return path[3:] if path.startswith("/v1/") else path


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


class Gateway:
    """The app's handlers over one :class:`Router` (module docstring)."""

    def __init__(
        self,
        router: Router,
        request_timeout: float = 3600.0,
        health_interval: float = 1.0,
        health_timeout: float = 2.0,
        health_failures_to_dead: int = 2,
    ):
        self.router = router
        self.request_timeout = request_timeout
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.health_failures_to_dead = health_failures_to_dead
        self._http: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app[_ROUTER_KEY] = self.router
        app.router.add_get("/health", self.health)
        app.router.add_get("/gateway/stats", self.stats)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._http = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.health_interval > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------------------------ own endpoints
    async def health(self, request: web.Request) -> web.Response:
        live = sum(w.alive for w in self.router.workers)
        body = {"status": "ok" if live else "no live proxy worker", "live_workers": live}
        return web.json_response(body, status=200 if live else 503)

    async def stats(self, request: web.Request) -> web.Response:
        result = self.router.keys.check(request.headers, need=auth.ADMIN)
        if not result.ok:
            return self._reject(request, result.reason)
        return web.json_response(self.router.describe())

    def _reject(self, request: web.Request, reason: str) -> web.Response:
        auth.log_rejection(request.method, request.path, request.remote, reason, "gateway")
        return _error(401, f"unauthorized: {reason}")

    # ------------------------------------------------------------------ dispatch
    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = _normalize(request.path)
        need = auth.ADMIN if path in ADMIN_PATHS else auth.SESSION
        result = self.router.keys.check(request.headers, need=need)
        if result.ok and need == auth.SESSION and result.session_id is None:
            result = auth.AuthResult(False, reason="a session API key is required here")
        if not result.ok:
            return self._reject(request, result.reason)
        self.router.stats.requests += 1
        body = await request.read()
        if path == "/rl/start_session":
            return await self._start_session(request, body)
        if path == "/export_trajectories":
            return await self._export(request, body)
        if path == "/grant_capacity":
            return await self._grant(request, body)
        if path == "/internal/wait_for_session":
            return await self._wait_for_session(request, body)
        route = self.router.routes.get(result.session_id or "")
        if route is None:
            return self._reject(request, "unknown or revoked API key")
        if route.failed:
            return self._session_failed(route)
        response = await self._forward(request, route.worker, body, route)
        if path == "/rl/end_session" and response.status == 200:
            self.router.ended(route)
        return response

    # ------------------------------------------------------------------ admin paths
    async def _start_session(self, request: web.Request, body: bytes) -> web.StreamResponse:
        api_key = _json(body).get("api_key")
        previous = self.router.route_of_key(api_key) if isinstance(api_key, str) else None
        if previous is not None and previous.failed:
            previous = None  # its worker is gone: the key starts afresh elsewhere
        tried: set[str] = set()
        while True:
            if previous is not None:
                worker = previous.worker
            else:
                try:
                    worker = self.router.pick()
                except NoLiveWorker as e:
                    self.router.record_failure("no live proxy worker")
                    return _error(503, str(e), _FAILED)
            tried.add(worker.url)
            worker.starting += 1  # counted as open until bound (no await between)
            try:
                status, data, ctype = await self._call(request, worker, body)
            except WorkerUnreachable as e:
                worker.starting -= 1
                if previous is None and any(
                    w.alive and w.url not in tried for w in self.router.workers
                ):
                    continue  # a new session: route it around the dead worker
                self.router.record_failure(str(e))
                return _error(502, f"starting a session failed: {e}", _FAILED)
            except BaseException:  # cancelled (the client went away) or a bug
                worker.starting -= 1
                raise
            worker.starting -= 1
            if status == 429 and previous is None:
                worker.open_grants = 0  # no open grant there after all; try another
                if any(
                    w.alive and w.open_grants > 0 and w.url not in tried
                    for w in self.router.workers
                ):
                    continue
            if status in (200, 201):  # 201: AReaL 2.0's v2 answer
                answer = _json(data)
                self.router.bind(answer["session_id"], answer["api_key"], worker)
            return web.Response(body=data, status=status, content_type=ctype)

    async def _export(self, request: web.Request, body: bytes) -> web.StreamResponse:
        sid = _json(body).get("session_id")
        route = self.router.routes.get(sid) if isinstance(sid, str) else None
        if route is None:
            return _error(404, f"session {sid} not found at the gateway")
        if route.failed:
            return self._session_failed(route)
        response = await self._forward(request, route.worker, body, route)
        if response.status == 200:
            self.router.exported(route.session_id)
        return response

    async def _grant(self, request: web.Request, body: bytes) -> web.StreamResponse:
        live = [w for w in self.router.workers if w.alive]
        if not live:
            return _error(503, "no live proxy worker behind the gateway", _FAILED)
        worker = min(live, key=lambda w: (w.open_sessions + w.open_grants, w.inflight))
        try:
            status, data, ctype = await self._call(request, worker, body)
        except WorkerUnreachable as e:
            self.router.record_failure(str(e))
            return _error(502, f"granting capacity failed: {e}", _FAILED)
        if status == 200:
            self.router.slots[_json(data)["slot_id"]] = worker
            worker.open_grants += 1
        return web.Response(body=data, status=status, content_type=ctype)

    async def _wait_for_session(self, request: web.Request, body: bytes) -> web.StreamResponse:
        slot = _json(body).get("slot_id")
        worker = self.router.slots.get(slot) if isinstance(slot, str) else None
        if worker is None:
            return _error(404, f"grant {slot} not found at the gateway (or its worker died)")
        response = await self._forward(request, worker, body)
        self.router.slots.pop(slot, None)
        return response

    # ------------------------------------------------------------------ forwarding
    def _session_failed(self, route: Route) -> web.Response:
        message = f"session {route.session_id} failed: {route.failed}"
        self.router.record_failure(route.failed)
        return _error(502, message, _FAILED)

    def _headers(self, request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}

    async def _open(self, request: web.Request, worker: ProxyWorker, body: bytes):
        """Send the request to ``worker``; the response (headers read) or WorkerUnreachable."""
        assert self._http is not None
        try:
            return await self._http.request(
                request.method,
                worker.url + request.path_qs,
                data=body,
                headers=self._headers(request),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=5),
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            raise await self._unreachable(worker, e) from None

    async def _call(self, request: web.Request, worker: ProxyWorker, body: bytes):
        """Forward and read the whole answer: ``(status, body, content_type)``."""
        worker.inflight += 1
        try:
            resp = await self._open(request, worker, body)
            async with resp:
                try:
                    data = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as e:
                    raise await self._unreachable(worker, e) from None
                return resp.status, data, resp.content_type
        finally:
            worker.inflight -= 1

    async def _forward(
        self, request: web.Request, worker: ProxyWorker, body: bytes, route: Route | None = None
    ) -> web.StreamResponse:
        """Forward to ``worker``; a streamed answer is passed on chunk by chunk."""
        worker.inflight += 1
        try:
            try:
                resp = await self._open(request, worker, body)
            except WorkerUnreachable as e:
                return self._forward_failed(route, str(e))
            async with resp:
                if resp.content_type != "text/event-stream":
                    try:
                        data = await resp.read()
                    except (aiohttp.ClientError, TimeoutError) as e:
                        return self._forward_failed(route, str(await self._unreachable(worker, e)))
                    return web.Response(
                        body=data, status=resp.status, content_type=resp.content_type
                    )
                out = web.StreamResponse(
                    status=resp.status,
                    headers={
                        "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                    },
                )
                await out.prepare(request)
                try:
                    async for chunk in resp.content.iter_any():
                        await out.write(chunk)
                except (aiohttp.ClientError, TimeoutError) as e:
                    reason = str(await self._unreachable(worker, e))
                    message = self._fail_message(route, reason)
                    event = {"type": "error", "error": {"message": message, "type": _FAILED}}
                    await out.write(f"event: error\ndata: {json.dumps(event)}\n\n".encode())
                await out.write_eof()
                return out
        finally:
            worker.inflight -= 1

    def _fail_message(self, route: Route | None, reason: str) -> str:
        if route is not None:
            self.router.record_failure(route.failed or reason)
            return f"session {route.session_id} failed: {route.failed or reason}"
        self.router.record_failure(reason)
        return reason

    def _forward_failed(self, route: Route | None, reason: str) -> web.Response:
        return _error(502, self._fail_message(route, reason), _FAILED)

    async def _unreachable(self, worker: ProxyWorker, exc: BaseException) -> WorkerUnreachable:
        """Probe ``worker`` after a failed forward; mark it dead when the probe fails too."""
        what = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if worker.alive and not await self._probe(worker):
            self.router.mark_dead(
                worker, f"proxy worker {worker.url} died or is unreachable ({what})"
            )
        if not worker.alive:
            return WorkerUnreachable(worker.reason)
        return WorkerUnreachable(f"forwarding to proxy worker {worker.url} failed ({what})")

    async def _probe(self, worker: ProxyWorker) -> bool:
        assert self._http is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout)
            async with self._http.get(worker.url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            workers = list(self.router.workers)
            results = await asyncio.gather(*(self._probe(w) for w in workers))
            for worker, ok in zip(workers, results, strict=True):
                if ok:
                    self.router.revive(worker)
                    continue
                worker.health_failures += 1
                if worker.alive and worker.health_failures >= self.health_failures_to_dead:
                    self.router.mark_dead(
                        worker,
                        f"proxy worker {worker.url} failed {worker.health_failures} health checks",
                    )


def _json(data: bytes) -> dict[str, Any]:
    """``data`` parsed as a JSON object (``{}`` when empty or not an object)."""
    if not data.strip():
        return {}
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
