"""``RemoteLocalEngine``: ``RemoteInfEngine`` for the built-in server (``areal.infra.launcher.local_server``)."""

from __future__ import annotations

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.remote_inf_engine import LocalBackend, RemoteInfEngine


class RemoteLocalEngine(RemoteInfEngine):
    """Client of built-in servers: native ``/generate`` with per-token weight versions."""

    def __init__(self, config: InferenceEngineConfig | None = None):
        super().__init__(config, backend=LocalBackend())
