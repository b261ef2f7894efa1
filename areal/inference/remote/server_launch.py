"""Starting inference servers from ``RemoteInfEngine``: a ``RolloutController`` that
starts them through a scheduler (``as_controller``), or one server process on this
machine (``launch_server`` / ``teardown_server``) from the backend's command
(``build_server_command``, filled in by each backend engine in ``areal.engine``).
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.launcher.server_process import launch_server_process
from areal.utils.network import find_free_ports


class ServerLaunchMixin:
    """Server processes of ``RemoteInfEngine`` (module docstring). Uses the engine's
    ``config``, ``backend`` and ``_launched`` (the started servers or server groups)."""

    @classmethod
    def as_controller(cls, config: InferenceEngineConfig, scheduler: Any) -> Any:
        """A ``RolloutController`` that starts this engine's servers through ``scheduler``
        and drives them from the calling process (``submit``/``wait``/``export_stats``)."""
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
