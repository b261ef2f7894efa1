"""Blocking client of one RPC worker (``rpc_server``)."""

from __future__ import annotations

import time
from typing import Any

import requests

from areal.api.scheduler_api import RemoteCallError
from areal.infra.rpc.batch_store import STORE_ENGINE
from areal.infra.rpc.serialization import CONTENT_TYPE, deserialize, serialize
from areal.infra.rpc.traffic import RPC_TRAFFIC
from areal.utils.auth import auth_headers, get_run_secret


class RPCClient:
    """Talks to ``http://{address}``; ``worker_id`` only names the worker in errors.

    ``timeout`` (seconds) bounds every call; ``None`` waits for as long as the method
    runs (callers such as ``LocalScheduler`` watch the worker's liveness meanwhile).
    ``secret``: the run secret sent with every request (default: ``AREAL_RUN_SECRET``).
    """

    def __init__(
        self,
        address: str,
        worker_id: str = "",
        connect_timeout: float = 10.0,
        secret: str | None = None,
    ):
        self.address = address
        self.worker_id = worker_id or address
        self.connect_timeout = connect_timeout
        self._headers = auth_headers(secret or get_run_secret())

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def health(self, timeout: float = 5.0) -> dict:
        resp = requests.get(f"{self.url}/health", timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def set_env(self, env: dict[str, str], timeout: float = 30.0) -> None:
        resp = requests.post(
            f"{self.url}/set_env", json={"env": env}, headers=self._headers, timeout=timeout
        )
        resp.raise_for_status()

    def _post(self, path: str, payload: dict, what: str, timeout: float | None) -> Any:
        t0 = time.perf_counter()
        body = serialize(payload)
        resp = requests.post(
            f"{self.url}{path}",
            data=body,
            headers={"Content-Type": CONTENT_TYPE, **self._headers},
            timeout=(self.connect_timeout, timeout),
        )
        if resp.headers.get("Content-Type", "").startswith(CONTENT_TYPE):
            out = deserialize(resp.content)
            RPC_TRAFFIC.record(
                self.worker_id,
                what,
                len(body),
                len(resp.content),
                time.perf_counter() - t0,
                float(out.get("exec_s", 0.0)) if isinstance(out, dict) else 0.0,
            )
        else:
            raise RuntimeError(
                f"Worker {self.worker_id} answered {what} with HTTP {resp.status_code}: {resp.text[:2000]}"
            )
        if not out.get("ok"):
            raise RemoteCallError(
                f"Worker {self.worker_id}: {what} raised {out.get('error_type')}: {out.get('error')}\n"
                f"--- remote traceback ({self.worker_id}) ---\n{out.get('traceback', '')}",
                worker_id=self.worker_id,
                method=what,
                remote_type=out.get("error_type", ""),
                remote_traceback=out.get("traceback", ""),
            )
        return out.get("result")

    def create_engine(
        self,
        engine: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> None:
        payload = {"engine": engine, "args": args, "kwargs": kwargs, "engine_name": engine_name}
        self._post("/create_engine", payload, f"create_engine({engine})", timeout)

    def call(
        self,
        method: str,
        *args,
        engine_name: str = "default",
        timeout: float | None = None,
        **kwargs,
    ) -> Any:
        payload = {"method": method, "args": args, "kwargs": kwargs, "engine_name": engine_name}
        what = method if engine_name != STORE_ENGINE else f"store.{method}"
        return self._post("/call", payload, what, timeout)
