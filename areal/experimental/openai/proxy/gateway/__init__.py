"""The proxy gateway: one address in front of several proxy workers (AReaL's proxy gateway).

- ``routing.py``: :class:`Router`, the routing state (workers, session routes, grants,
  counters); session-affine, new sessions to the least-loaded live worker.
- ``app.py``: the aiohttp app (key check with :mod:`areal.utils.auth`, forwarding with
  streams passed through, dead-worker handling, health checks).
- ``server.py``: :class:`GatewayServer`, the app in a thread of this process (default-key
  refusal off loopback, generated key file).
- ``launch.py``: proxy workers as the scheduler role ``proxy`` plus their gateway
  (``rollout.agent.proxy_workers``).
- ``__main__.py``: ``python -m areal.experimental.openai.proxy.gateway`` (serves through
  ``areal.experimental.openai.proxy.entry``, as the proxy's own entry does).
"""

from __future__ import annotations

from areal.experimental.openai.proxy.gateway.launch import (
    PROXY_ROLE,
    proxy_worker_command,
    start_proxy_gateway,
    start_proxy_workers,
)
from areal.experimental.openai.proxy.gateway.routing import ProxyWorker, Route, Router
from areal.experimental.openai.proxy.gateway.server import GatewayServer

__all__ = [
    "PROXY_ROLE",
    "GatewayServer",
    "ProxyWorker",
    "Route",
    "Router",
    "proxy_worker_command",
    "start_proxy_gateway",
    "start_proxy_workers",
]
