"""Proxy workers as a scheduler role, and the gateway in front of them.

``start_proxy_gateway(scheduler, agent_config, server_addrs, tokenizer_path)``, in order:

1. refuses the default admin key when the gateway would bind a non-loopback address;
2. starts ``agent_config.proxy_workers`` command workers of role ``proxy`` through the
   scheduler (local, Ray or Slurm: the mechanism the inference servers use,
   ``areal.infra.scheduler.servers.launch_server_workers``), each running
   ``python -m areal.experimental.openai.proxy`` in front of all ``server_addrs``, with
   the admin key in its environment, and waits until each answers ``/health``;
3. starts a :class:`GatewayServer` on ``agent_config.proxy_host:proxy_port`` (the address
   the trainer's agent workflows and external clients use) routing to those workers.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from areal.experimental.openai.proxy.gateway.server import HOW_TO_SET_KEY, GatewayServer
from areal.infra.scheduler.servers import launch_server_workers
from areal.utils import auth, logging

logger = logging.getLogger("ProxyGateway")

#: Scheduler role of the proxy workers.
PROXY_ROLE = "proxy"


def _esc(value: str) -> str:
    # schedulers fill {host}/{port} in with str.format
    return value.replace("{", "{{").replace("}", "}}")


def proxy_worker_command(
    server_addrs: list[str],
    tokenizer_path: str,
    agent_config: Any,
    request_timeout: float = 3600.0,
    python: str = sys.executable,
    start_session_status: int = 200,
) -> str:
    """The command (``{host}``/``{port}`` placeholders) of one proxy worker.

    ``agent_config``: the ``AgentConfig`` (parsers, chat template, token limit, session
    timeout, ``mode``: online mode gives the workers grants)."""
    cfg = agent_config
    argv = [
        python,
        "-m",
        "areal.experimental.openai.proxy",
        "--server-addrs",
        _esc(",".join(server_addrs)),
        "--tokenizer",
        _esc(tokenizer_path),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--chat-template-type",
        cfg.chat_template_type,
        "--tool-call-parser",
        cfg.tool_call_parser,
        "--reasoning-parser",
        cfg.reasoning_parser,
        "--session-timeout-seconds",
        str(cfg.session_timeout_seconds),
        "--request-timeout",
        str(request_timeout),
    ]
    if cfg.engine_max_tokens is not None:
        argv += ["--engine-max-tokens", str(cfg.engine_max_tokens)]
    if cfg.mode == "online":
        argv.append("--online")
    if start_session_status != 200:
        argv += ["--start-session-status", str(start_session_status)]
    return shlex.join(argv)


def start_proxy_workers(
    scheduler: Any,
    n_workers: int,
    command: str,
    admin_api_key: str,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Start ``n_workers`` proxy workers of role ``proxy``; their base URLs once healthy."""
    env = {**(env or {}), auth.PROXY_ADMIN_KEY_ENV: admin_api_key}
    addrs = launch_server_workers(
        scheduler, n_workers, command, env=env, timeout=timeout, role=PROXY_ROLE
    )
    return [a if a.startswith("http") else f"http://{a}" for a in addrs]


def start_proxy_gateway(
    scheduler: Any,
    agent_config: Any,
    server_addrs: list[str],
    tokenizer_path: str,
    request_timeout: float = 3600.0,
    setup_timeout: float = 300.0,
    start_session_status: int = 200,
) -> GatewayServer:
    """Proxy workers plus their gateway (module docstring); returns the started gateway."""
    cfg = agent_config
    if cfg.proxy_workers < 1:
        raise ValueError(f"rollout.agent.proxy_workers={cfg.proxy_workers}; the gateway needs >= 1")
    auth.refuse_default_key_off_loopback(
        cfg.proxy_host, cfg.admin_api_key, "the proxy gateway", HOW_TO_SET_KEY
    )
    command = proxy_worker_command(
        server_addrs,
        tokenizer_path,
        cfg,
        request_timeout,
        start_session_status=start_session_status,
    )
    urls = start_proxy_workers(
        scheduler, cfg.proxy_workers, command, cfg.admin_api_key, timeout=setup_timeout
    )
    gateway = GatewayServer(
        urls,
        admin_api_key=cfg.admin_api_key,
        host=cfg.proxy_host,
        port=cfg.proxy_port,
        request_timeout=request_timeout,
    )
    return gateway.start()
