"""Shared part of the schedulers: engine calls on RPC workers, in terms of ``_rpc``."""

from __future__ import annotations

from typing import Any


class RPCEngineMixin:
    """``create_engine`` / ``call_engine`` / ``set_worker_env`` for schedulers with RPC workers.

    The scheduler provides ``_rpc(worker_id, what, fn_name, *args, timeout=None, **kwargs)``,
    which calls ``RPCClient.<fn_name>`` on the worker and turns a dead worker into a
    ``WorkerDiedError`` (each scheduler knows how to tell that its workers died).
    """

    def _rpc(
        self, worker_id: str, what: str, fn_name: str, *args, timeout: float | None = None, **kwargs
    ) -> Any:
        raise NotImplementedError

    def create_engine(
        self,
        worker_id: str,
        engine: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> None:
        """Instantiate ``engine`` (import path, e.g. ``areal.trainer.ppo.actor.FSDPPPOActor``) in the worker."""
        self._rpc(
            worker_id,
            f"create_engine({engine})",
            "create_engine",
            engine,
            *args,
            engine_name=engine_name,
            timeout=timeout,
            **kwargs,
        )

    def call_engine(
        self,
        worker_id: str,
        method: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> Any:
        """``engine.method(*args, **kwargs)`` in the worker; remote errors raise ``RemoteCallError``."""
        return self._rpc(
            worker_id,
            method,
            "call",
            method,
            *args,
            engine_name=engine_name,
            timeout=timeout,
            **kwargs,
        )

    def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        """Update ``os.environ`` inside an RPC worker (before ``create_engine``)."""
        self._rpc(worker_id, "set_env", "set_env", env)
