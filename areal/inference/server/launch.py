"""Launching built-in servers as local processes (tests, benchmarks, ``RemoteLocalEngine``).

    group = launch_local_server(model_path, num_servers=2)
    group.addresses  # ["127.0.0.1:PORT", ...]
    group.shutdown()

Trainers start servers through a scheduler instead (``areal.inference.backends``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from areal.infra.launcher.server_process import (
    ServerProcess,
    launch_server_process,
    wait_for_servers,
)
from areal.utils import logging

logger = logging.getLogger("LocalServer")

SERVER_MODULE = "areal.inference.server"


@dataclasses.dataclass
class LocalServerGroup:
    servers: list[ServerProcess]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def shutdown(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> LocalServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def local_server_cmd(
    model_path: str, host: str, port: int, server_args: dict[str, Any] | None = None
) -> list[str]:
    cmd = [sys.executable, "-m", SERVER_MODULE, "--model-path", model_path]
    cmd += ["--host", host, "--port", str(port)]
    for k, v in (server_args or {}).items():
        if v is None or v is False:
            continue
        cmd.append("--" + k.replace("_", "-"))
        if v is not True:
            cmd.append(str(v))
    return cmd


def launch_local_server(
    model_path: str,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    ports: list[int] | None = None,
    server_args: dict[str, Any] | None = None,
    timeout: float = 120.0,
    log_dir: str | None = None,
) -> LocalServerGroup:
    """Start ``num_servers`` built-in servers and wait until all are healthy."""
    from areal.utils.network import find_free_ports

    ports = list(ports) if ports else find_free_ports(num_servers)
    if len(ports) != num_servers:
        raise ValueError(f"got {len(ports)} ports for num_servers={num_servers}")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    servers: list[ServerProcess] = []
    try:
        for i, port in enumerate(ports):
            log_path = os.path.join(log_dir, f"local_server_{i}.log") if log_dir else None
            servers.append(
                launch_server_process(
                    local_server_cmd(model_path, host, port, server_args),
                    f"{host}:{port}",
                    timeout=timeout,
                    log_path=log_path,
                    wait=False,
                )
            )
        wait_for_servers(servers, timeout=timeout)
    except BaseException:
        for s in servers:
            s.stop(timeout=3.0)
        raise
    logger.info("%d local inference server(s) up: %s", num_servers, [s.address for s in servers])
    return LocalServerGroup(servers)
