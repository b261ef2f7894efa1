"""Run one Python snippet in a fresh sandbox (:class:`Sandbox`).

What happens for one :meth:`Sandbox.run_python`, in order:

1. (once per configuration, at construction) the probe runs ``pass`` through the whole
   chain below; when the namespaces cannot be created it raises
   :class:`SandboxUnavailableError` saying what is missing and how to allow it;
2. spawn ``unshare --net --pid --fork --kill-child --mount --mount-proc --ipc --uts``
   (plus ``--user --map-root-user`` when this process is not root) running
   ``launch_pid1.py`` in its own session, with an environment of only ``PATH``, ``HOME``,
   ``TMPDIR``, ``LANG`` and single-thread BLAS settings: no secret of this process reaches
   it; ``launch_pid1.py`` confines the filesystem, sets the rlimits, drops to the sandbox uid
   and execs the snippet;
3. write the snippet to its stdin, read stdout and stderr, each capped at
   ``max_output_bytes`` (the run is killed past it), until both close or the wall limit
   passes (then the process group is killed; ``--kill-child`` takes down the namespace);
4. read the launcher's JSON report (exit code or signal, CPU time, a limit the snippet
   hit) and name the reason in a :class:`SandboxResult`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from areal.utils import logging
from areal.utils.sandbox.config import SandboxConfig, SandboxResult, SandboxUnavailableError

__all__ = ["Sandbox"]

logger = logging.getLogger("Sandbox")

LAUNCHER = Path(__file__).with_name("launch_pid1.py")
WORKDIR = "/tmp/sandbox"
_PROBED: set[tuple] = set()
_PROBE_LOCK = threading.Lock()

_HOW_TO_ALLOW = (
    "The sandbox needs util-linux `unshare` and the right to create network, PID and mount "
    "namespaces: run as root (in Docker: --privileged, or --cap-add SYS_ADMIN with a "
    "seccomp/AppArmor profile that allows unshare and mount), or, as a normal user, allow "
    "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
    "user.max_user_namespaces > 0, kernel.apparmor_restrict_unprivileged_userns=0). "
    "Model-written code is never run unconfined."
)


class Sandbox:
    """Runs snippets confined as described in the module docstring; safe to share
    between coroutines and threads (each run is its own process tree)."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.python = self.config.python or sys.executable
        self._uids = itertools.cycle(range(self.config.uid_pool_size))
        found = shutil.which(self.config.unshare_binary)
        if found is None:
            raise SandboxUnavailableError(
                f"`{self.config.unshare_binary}` not found (util-linux). {_HOW_TO_ALLOW}"
            )
        self.unshare = found
        self.as_root = os.geteuid() == 0
        self._probe()

    # -- public API ---------------------------------------------------------------
    async def run_python(self, code: str, timeout: float | None = None) -> SandboxResult:
        """Run ``code`` as ``__main__``; ``timeout`` (s) lowers the wall limit for this run."""
        wall = self.config.wall_time_s if timeout is None else min(timeout, self.config.wall_time_s)
        slot = next(self._uids)
        start = time.monotonic()
        report_r, report_w = os.pipe()
        argv = self._argv(slot, report_w)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env(),
                pass_fds=(report_w,),
                start_new_session=True,
            )
        finally:
            os.close(report_w)
        try:
            return await self._collect(proc, code, wall, start, report_r)
        finally:
            os.close(report_r)
            _kill_group(proc)
            if proc.returncode is None:
                await proc.wait()

    def run_python_sync(self, code: str, timeout: float | None = None) -> SandboxResult:
        """:meth:`run_python` for synchronous callers (not from a running event loop)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.run_python(code, timeout))
        raise RuntimeError("run_python_sync called inside an event loop: await run_python")

    # -- internals ----------------------------------------------------------------
    def _spec(self, slot: int, report_fd: int) -> dict:
        c = self.config
        keep = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)})
        keep.append(os.path.dirname(os.path.realpath(self.python)))
        return {
            "report_fd": report_fd,
            "uid": c.uid + slot,
            "gid": c.gid,
            "user_namespace": not self.as_root,
            "workdir": WORKDIR,
            "file_size_mb": c.file_size_mb,
            "hidden_paths": list(c.hidden_paths),
            "keep_paths": keep,
            "python": self.python,
            "env": self._env(),
            "limits": {
                "cpu_time_s": c.cpu_time_s,
                "memory_mb": c.memory_mb,
                "max_processes": c.max_processes,
                "max_open_files": c.max_open_files,
            },
        }

    def _argv(self, slot: int, report_fd: int) -> list[str]:
        flags = ["--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
        flags += ["--ipc", "--uts"]
        if not self.as_root:
            flags = ["--user", "--map-root-user", *flags]
        spec = json.dumps(self._spec(slot, report_fd))
        return [self.unshare, *flags, "--", self.python, "-I", "-B", str(LAUNCHER), spec]

    def _env(self) -> dict[str, str]:
        path = os.pathsep.join([os.path.dirname(self.python), "/usr/local/bin", "/usr/bin", "/bin"])
        env = {"PATH": path, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = "1"
        env["MALLOC_ARENA_MAX"] = "2"
        return env

    async def _collect(self, proc, code: str, wall: float, start: float, report_r: int):
        cap = self.config.max_output_bytes
        over = asyncio.Event()
        streams = [_CappedReader(proc.stdout, cap, over), _CappedReader(proc.stderr, cap, over)]

        async def feed():
            try:
                proc.stdin.write(code.encode())
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        readers = [asyncio.ensure_future(s.read()) for s in streams]
        readers.append(asyncio.ensure_future(feed()))
        done = asyncio.ensure_future(asyncio.gather(*readers))
        limit_hit = asyncio.ensure_future(over.wait())
        await asyncio.wait([done, limit_hit], timeout=wall, return_when=asyncio.FIRST_COMPLETED)
        error = None
        if not done.done():
            error = "output limit" if over.is_set() else "timeout"
            _kill_group(proc)
        limit_hit.cancel()
        await asyncio.gather(done, return_exceptions=True)
        try:  # a snippet that closed its stdout and stderr may still be running
            await asyncio.wait_for(proc.wait(), max(0.0, wall - (time.monotonic() - start)))
        except TimeoutError:
            error = error or "timeout"
            _kill_group(proc)
            await proc.wait()
        duration = time.monotonic() - start
        report = _read_report(report_r)
        if error is None:
            error = self._reason(report, proc.returncode)
        out, err = streams
        return SandboxResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=report.get("exit_code"),
            error=error,
            duration_s=duration,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            cpu_time_s=report.get("cpu_s"),
        )

    def _reason(self, report: dict, returncode: int | None) -> str | None:
        if "setup_error" in report:
            return f"sandbox setup failed: {report['setup_error']}"
        if not report:
            return f"sandbox setup failed: unshare exited {returncode}"
        sig = report.get("signal")
        if sig is not None:
            if sig == signal.SIGXCPU or report.get("cpu_s", 0) >= self.config.cpu_time_s:
                return "cpu time limit"
            if sig == signal.SIGXFSZ:
                return "file size limit"
            return f"killed by signal {sig}"
        if report.get("reason"):
            return report["reason"]
        code = report.get("exit_code")
        return None if code == 0 else f"exit code {code}"

    def _probe(self) -> None:
        key = (
            self.unshare,
            self.python,
            self.as_root,
            self.config.uid,
            tuple(self.config.hidden_paths),
        )
        with _PROBE_LOCK:
            if key in _PROBED:
                return
            result = _run_outside_loop(self.run_python("print('ok')", timeout=30))
            if result.error is not None or result.stdout.strip() != "ok":
                raise SandboxUnavailableError(
                    f"cannot start a confined snippet with {self.unshare} "
                    f"({'as root' if self.as_root else 'as uid ' + str(os.geteuid())}): "
                    f"{result.error}; stderr: {result.stderr.strip()[-800:]!r}. The "
                    f"interpreter {self.python} must be executable by uid {self.config.uid} "
                    f"(its prefix under a hidden path is brought back). {_HOW_TO_ALLOW}"
                )
            _PROBED.add(key)


class _CappedReader:
    """Reads a stream to its end, keeping at most ``cap`` bytes; past it sets ``over``
    (the runner then kills the run) and discards the rest until the pipe closes."""

    def __init__(self, stream: asyncio.StreamReader, cap: int, over: asyncio.Event):
        self.stream, self.cap, self.over = stream, cap, over
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    async def read(self) -> None:
        while chunk := await self.stream.read(65536):
            room = self.cap - self.size
            if len(chunk) > room:
                self.chunks.append(chunk[:room])
                self.size = self.cap
                self.truncated = True
                self.over.set()
            elif chunk:
                self.chunks.append(chunk)
                self.size += len(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


def _run_outside_loop(coro):
    """``asyncio.run(coro)``, in a helper thread when this thread runs an event loop (a
    sandbox built inside a coroutine: the probe then blocks that loop once, briefly)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box = []
    worker = threading.Thread(target=lambda: box.append(asyncio.run(coro)), name="SandboxProbe")
    worker.start()
    worker.join()
    return box[0]


def _read_report(fd: int) -> dict:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 65536).decode(errors="replace")
    except BlockingIOError:
        return {}
    for line in data.splitlines():
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def _kill_group(proc) -> None:
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
