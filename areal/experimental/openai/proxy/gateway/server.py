"""``GatewayServer``: the gateway app on its own event loop, in a thread of this process.

``start()``, in order: refuse the well-known default admin key on a non-loopback
``host`` (before any socket is opened); with no admin key given, generate one and write
it to a file only this user can read (path logged); bind the socket; serve the app
(:mod:`.app`) in a background thread until ``stop()``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from aiohttp import web

from areal.experimental.openai.proxy.gateway.app import Gateway
from areal.experimental.openai.proxy.gateway.routing import Router
from areal.utils import auth, logging

logger = logging.getLogger("ProxyGateway")

#: How a user gives the gateway (and its proxy workers) an admin key.
HOW_TO_SET_KEY = (
    f"rollout.agent.admin_api_key=<secret> (trainer) or the {auth.PROXY_ADMIN_KEY_ENV} "
    "environment variable (python -m areal.experimental.openai.proxy[.gateway])"
)


class GatewayServer:
    """Session-affine gateway in front of the proxy workers at ``worker_urls``.

    ``admin_api_key``: the proxy workers' admin key (None: generate one, written to
    ``key_file`` or a default path, see :func:`areal.utils.auth.generate_admin_key_file`).
    ``base_url`` is what agents and the trainer's workflows use as the proxy address.
    """

    def __init__(
        self,
        worker_urls: list[str],
        admin_api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        key_file: str | None = None,
        request_timeout: float = 3600.0,
        health_interval: float = 1.0,
    ):
        self.worker_urls = list(worker_urls)
        self.admin_api_key = admin_api_key
        self.key_file: str | None = key_file
        self.host = host
        self._port = port
        self.request_timeout = request_timeout
        self.health_interval = health_interval
        self.gateway: Gateway | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("GatewayServer is not started")
        return self._sock.getsockname()[1]

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def router(self) -> Router:
        if self.gateway is None:
            raise RuntimeError("GatewayServer is not started")
        return self.gateway.router

    def stats(self) -> dict[str, Any]:
        """The gateway's counters and workers (as ``GET /gateway/stats``), thread-safe."""
        assert self._loop is not None

        async def read() -> dict[str, Any]:
            return self.router.describe()

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(10)

    def start(self, timeout: float = 30.0) -> GatewayServer:
        if self._thread is not None:
            return self
        auth.refuse_default_key_off_loopback(
            self.host, self.admin_api_key, "the proxy gateway", HOW_TO_SET_KEY
        )
        if self.admin_api_key is None:
            self.admin_api_key, self.key_file = auth.generate_admin_key_file(
                "gateway", self.key_file
            )
        self.gateway = Gateway(
            Router(self.worker_urls, self.admin_api_key),
            request_timeout=self.request_timeout,
            health_interval=self.health_interval,
        )
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        self._sock = sock
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name="proxy-gateway", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout) or self._runner is None:
            raise RuntimeError(f"the proxy gateway did not start on {self.host}:{self.port}")
        logger.info(
            f"proxy gateway listening on {self.base_url} in front of {len(self.worker_urls)} "
            f"proxy worker(s): {', '.join(self.worker_urls)}"
        )
        return self

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None and self.gateway is not None and self._sock is not None
        asyncio.set_event_loop(loop)

        async def up() -> None:
            runner = web.AppRunner(self.gateway.make_app(), access_log=None)
            await runner.setup()
            await web.SockSite(runner, self._sock).start()
            self._runner = runner

        try:
            loop.run_until_complete(up())
        finally:
            ready.set()
        if self._runner is not None:
            loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        loop, runner = self._loop, self._runner
        if loop is not None and runner is not None and loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(runner.cleanup(), loop)
            try:
                fut.result(timeout)
            except Exception as e:  # noqa: BLE001 - stopping anyway
                logger.warning(f"gateway cleanup: {e!r}")
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        self._thread = None
        self._runner = None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
