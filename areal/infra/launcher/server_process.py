"""Generic launching of HTTP server processes (inference servers of any backend).

``launch_server_process(cmd, address)`` starts a command in its own process group, waits
for its health endpoint and returns a ``ServerProcess``; every process started here is
killed at interpreter exit. Which command starts which server is decided by the caller
(the backend registry ``areal.inference.backends``): this module knows no backend.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import subprocess
import tempfile
import threading
import time

from areal.utils import logging

logger = logging.getLogger("ServerProcess")

_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


@dataclasses.dataclass(eq=False)
class ServerProcess:
    """One server subprocess (own process group) and its address ``host:port``."""

    proc: subprocess.Popen
    address: str
    log_path: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return "<no log>"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            try:  # children of a dead leader
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with _LIVE_LOCK:
            _LIVE.discard(self)


def _stop_all_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for sp in live:
        sp.stop(timeout=3.0)


atexit.register(_stop_all_live)


def _healthy(address: str, path: str = "/health", timeout: float = 2.0) -> bool:
    import requests

    try:
        return requests.get(f"http://{address}{path}", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def launch_server_process(
    cmd: list[str],
    address: str,
    health_path: str = "/health",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    wait: bool = True,
) -> ServerProcess:
    """Start ``cmd`` in its own process group and (if ``wait``) wait for ``GET health_path``.

    Raises ``RuntimeError`` with the log tail if the process exits before it is healthy,
    ``TimeoutError`` (process killed) if it is not healthy within ``timeout`` seconds.
    """
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="areal-server-", suffix=".log")
        os.close(fd)
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    sp = ServerProcess(proc, address, log_path)
    with _LIVE_LOCK:
        _LIVE.add(sp)
    if wait:
        try:
            wait_for_servers([sp], health_path, timeout)
        except BaseException:
            sp.stop(timeout=3.0)
            raise
    return sp


def wait_for_servers(
    servers: list[ServerProcess], health_path: str = "/health", timeout: float = 120.0
) -> None:
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for sp in list(pending):
            if not sp.alive():
                raise RuntimeError(
                    f"inference server {sp.address} exited with code {sp.proc.returncode} during start; "
                    f"log {sp.log_path} ends with:\n{sp.log_tail()}"
                )
            if _healthy(sp.address, health_path):
                pending.remove(sp)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"inference server(s) {[s.address for s in pending]} not healthy after {timeout:.0f} s; "
                f"log of {pending[0].address}:\n{pending[0].log_tail()}"
            )
        time.sleep(0.2)
