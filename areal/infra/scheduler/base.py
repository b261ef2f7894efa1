"""Shared part of the schedulers: worker lookup by role, and engine calls on RPC workers."""

from __future__ import annotations

import time
from typing import Any


class RPCEngineMixin:
    """``create_engine`` / ``call_engine`` / ``set_worker_env`` for schedulers with RPC workers.

    The scheduler provides ``_rpc(worker_id, what, fn_name, *args, timeout=None, **kwargs)``,
    which calls ``RPCClient.<fn_name>`` on the worker and turns a dead worker into a
    ``WorkerDiedError`` (each scheduler knows how to tell that its workers died).
    """

    # Schedulers keep ``self._lock``, ``self._roles`` (role -> list of worker records with a
    # ``.worker`` attribute) and ``self._aliases`` (colocated role -> target role).
    def _workers(self, role: str) -> list[Any]:
        with self._lock:
            role = self._aliases.get(role, role)
            if role not in self._roles:
                raise KeyError(
                    f"No workers with role {role!r}; have {sorted(self._roles) + sorted(self._aliases)}"
                )
            return list(self._roles[role])

    def _worker(self, worker_id: str) -> Any:
        role, _, index = worker_id.rpartition("/")
        ws = self._workers(role)
        try:
            return ws[int(index)]
        except (ValueError, IndexError):
            raise KeyError(f"No worker {worker_id!r}") from None

    def _wait_for_role(self, role: str, timeout: float | None) -> list[Any]:
        """The role's worker records, waiting up to ``timeout`` s for the role to appear."""
        deadline = time.monotonic() + (timeout or 0)
        while True:
            try:
                return self._workers(role)
            except KeyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

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
