"""The two Ray actor kinds of ``RayScheduler`` (``areal.infra.scheduler.ray``).

- ``RPCWorkerActor``: the ``rpc_server`` HTTP app (``EngineHost`` + ``build_app``) on a
  thread inside the actor, bound to the node IP;
- ``CommandWorkerActor``: one command (e.g. an inference server) as a subprocess of the
  actor (own process group, killed with the actor); its output goes to the worker's log
  file and to the actor's stdout.

Plain classes: ``ray.remote`` is applied by the scheduler.
"""

from __future__ import annotations

import asyncio
import logging as std_logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from areal.infra.scheduler.base import LOG_TAIL_LINES, read_log_tail, set_pdeathsig
from areal.utils import logging
from areal.utils.network import find_free_ports


class _ActorBase:
    """Shared parts of the two actor kinds (plain classes; ``ray.remote`` is applied lazily)."""

    def __init__(self, worker_id: str, log_path: str):
        import ray

        self.worker_id = worker_id
        self.log_path = log_path
        self.ip = ray.util.get_node_ip_address()
        self._stopped = threading.Event()
        os.makedirs(os.path.dirname(log_path), exist_ok=True)

    def node_info(self, port_count: int) -> dict:
        import ray

        return {
            "ip": self.ip,
            "ports": find_free_ports(port_count, host=self.ip),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "log_path": self.log_path,
        }

    def ping(self) -> int:
        return os.getpid()

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return read_log_tail(self.log_path, n)


class RPCWorkerActor(_ActorBase):
    """Hosts ``rpc_server``'s app on a thread; engines run on its single engine thread."""

    def __init__(self, worker_id: str, log_path: str):
        super().__init__(worker_id, log_path)
        handler = std_logging.FileHandler(log_path)
        logging.getLogger("RPCServer")  # configures the "areal" root logger
        root = std_logging.getLogger("areal")
        if root.handlers:
            handler.setFormatter(root.handlers[0].formatter)
        root.addHandler(handler)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, port: int, env: dict[str, str], startup_timeout: float = 60.0) -> dict:
        import torch

        from areal.infra.rpc.rpc_server import EngineHost, build_app

        os.environ.update(env)
        torch.set_num_threads(int(os.environ.get("AREAL_WORKER_NUM_THREADS", "1")))
        started = threading.Event()
        failure: list[BaseException] = []

        def _serve() -> None:
            from aiohttp import web

            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                runner = web.AppRunner(build_app(EngineHost()), access_log=None)
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.TCPSite(runner, self.ip, port).start())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                failure.append(e)
                started.set()
                return
            started.set()
            loop.run_forever()

        threading.Thread(target=_serve, daemon=True, name="rpc-http").start()
        if not started.wait(startup_timeout):
            raise TimeoutError(
                f"{self.worker_id}: HTTP server did not start in {startup_timeout} s"
            )
        if failure:
            raise RuntimeError(
                f"{self.worker_id}: HTTP server on {self.ip}:{port} failed: {failure[0]!r}"
            )
        logging.getLogger("RayRPCWorker").info(
            f"{self.worker_id} (pid {os.getpid()}) serving on {self.ip}:{port}"
        )
        return {"ip": self.ip, "port": port}

    def run_until_stopped(self) -> int:
        self._stopped.wait()
        return 0

    def stop(self, grace: float = 5.0) -> None:
        self._stopped.set()


class CommandWorkerActor(_ActorBase):
    """Runs one command as a subprocess; its output goes to the log file and the actor's stdout."""

    def __init__(self, worker_id: str, log_path: str):
        super().__init__(worker_id, log_path)
        self.proc: subprocess.Popen | None = None
        self._forwarder: threading.Thread | None = None

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> int:
        full_env = dict(os.environ)
        full_env.update(env)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            start_new_session=True,
            preexec_fn=set_pdeathsig if sys.platform == "linux" else None,
        )
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed by the forwarder
        log.write(
            f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {shlex.join(argv)}\n".encode()
        )
        log.flush()

        def _forward(stream, log_file) -> None:
            with log_file:
                for line in iter(stream.readline, b""):
                    log_file.write(line)
                    log_file.flush()
                    try:
                        sys.stdout.write(line.decode(errors="replace"))
                        sys.stdout.flush()
                    except Exception:  # noqa: BLE001
                        pass

        self._forwarder = threading.Thread(
            target=_forward, args=(self.proc.stdout, log), daemon=True, name="log-forward"
        )
        self._forwarder.start()
        return self.proc.pid

    def run_until_stopped(self) -> int:
        while self.proc is None:
            if self._stopped.wait(0.1):
                return 0
        code = self.proc.wait()
        if self._forwarder is not None:
            self._forwarder.join(timeout=5)
        return code

    def stop(self, grace: float = 5.0) -> None:
        self._stopped.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
