"""The sandbox for model-written code (areal/utils/sandbox): one hostile snippet per limit,
run from this (root) test process; each is stopped or refused and its reason reported."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from areal.utils.sandbox import (
    PythonTool,
    Sandbox,
    SandboxConfig,
    SandboxUnavailableError,
    run_tests_against,
    run_tests_against_sync,
)

REPO = Path(__file__).resolve().parents[1]
CAP = 64 * 1024

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux namespaces")


# A uid of this file's own: other test files run sandboxes as nobody (65534) at the same
# time, and RLIMIT_NPROC counts per uid across the host, so the fork bomb here would starve
# them and their processes would blur the process counts here.
UID = 64990


@pytest.fixture(scope="module")
def sandbox():
    config = SandboxConfig(
        wall_time_s=30,
        cpu_time_s=1,
        memory_mb=512,
        max_processes=16,
        max_output_bytes=CAP,
        uid=UID,
    )
    return Sandbox(config)


def run(sandbox, code, **kw):
    return sandbox.run_python_sync(code, **kw)


def _sandbox_uid_processes(uid=UID):
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]


def test_sandbox_normal_snippet_returns_stdout_as_unprivileged_uid(sandbox):
    r = run(sandbox, "import os\nprint(6 * 7)\nprint(os.getuid(), os.getgid(), os.getcwd())")
    assert r.ok and r.error is None and r.exit_code == 0, r
    assert r.stdout.split() == ["42", str(UID), "65534", "/tmp/sandbox"]


def test_sandbox_infinite_loop_cpu_time_limit(sandbox):
    r = run(sandbox, "while True:\n    pass")
    assert r.error == "cpu time limit", r
    assert 0.5 <= r.cpu_time_s < 3.0  # CPU seconds (the limit's), not wall time


def test_sandbox_sleeping_snippet_wall_timeout(sandbox):
    # killed at the 1.5 s limit, not after the 60 s sleep (generous: half of it)
    r = run(sandbox, "import time\ntime.sleep(60)", timeout=1.5)
    assert r.error == "timeout", r
    assert 1.4 < r.duration_s < 30
    # Closing its output does not let a snippet outlive the wall limit.
    r = run(sandbox, "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", timeout=1.5)
    assert r.error == "timeout", r
    assert 1.4 < r.duration_s < 30


def _descendants() -> dict[int, psutil.Process]:
    return {c.pid: c for c in psutil.Process().children(recursive=True)}


def _is_sandbox_uid(p: psutil.Process, config: SandboxConfig) -> bool:
    try:
        return config.uid <= p.uids().real < config.uid + config.uid_pool_size
    except psutil.NoSuchProcess:
        return False


def _still_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sandbox_cancelled_run_leaves_no_process(sandbox):
    # The processes this run starts (unshare, PID 1, the snippet), found as descendants of
    # this test process: other test files run sandboxes as the same uid at the same time.
    before = set(_descendants())

    async def main():
        task = asyncio.create_task(sandbox.run_python("import time\ntime.sleep(60)"))
        started: dict[int, psutil.Process] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            started = {pid: p for pid, p in _descendants().items() if pid not in before}
            if any(_is_sandbox_uid(p, sandbox.config) for p in started.values()):
                break
        assert any(_is_sandbox_uid(p, sandbox.config) for p in started.values()), started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return started

    start = time.monotonic()
    started = asyncio.run(main())
    assert time.monotonic() - start < 30  # killed at the cancellation, not after its 60 s
    # Every one of them is gone (a zombie waiting for its reaper counts as gone).
    deadline = time.monotonic() + 10
    alive = list(started.values())
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _still_running(p)]
        time.sleep(0.05)
    assert not alive, alive


def test_sandbox_fork_bomb_process_limit_and_host_unaffected(sandbox):
    before = len(psutil.pids())
    nobody_before = len(_sandbox_uid_processes())
    r = run(sandbox, "import os\nwhile True:\n    os.fork()")
    assert r.error == "process limit", r
    assert "BlockingIOError" in r.stderr
    # Everything the bomb forked died with its PID namespace.
    assert len(_sandbox_uid_processes()) <= nobody_before
    assert len(psutil.pids()) < before + 16
    assert run(sandbox, "print('still fine')").stdout == "still fine\n"


def test_sandbox_allocating_10gb_memory_limit(sandbox):
    r = run(sandbox, "x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert r.error == "memory limit", r
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_sandbox_writing_outside_its_directory_refused(sandbox):
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", str(REPO / name), f"/dev/shm/{name}", f"/var/tmp/{name}"]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "open('mine.txt', 'w').write('ok')\n"
        "print('own dir', open('mine.txt').read())\n"
        "open(os.path.join(os.path.dirname(os.__file__), 'os.py'), 'a')\n"
    )
    r = run(sandbox, code)
    assert "WROTE" not in r.stdout
    # errno 30 (EROFS): refused by the read-only mounts, whatever the uid may write.
    assert r.stdout.count("refused 30") == len(targets) and "own dir ok" in r.stdout
    assert r.error == "exit code 1", r
    assert "PermissionError" in r.stderr or "Read-only file system" in r.stderr
    for path in targets:
        assert not os.path.exists(path)


def test_sandbox_secrets_not_in_env_nor_trainer_proc_environ(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AREAL_RUN_SECRET", secret)
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    # A "trainer" started with the secret in its initial environment (what
    # /proc/<pid>/environ shows); the control: it is readable from the host.
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while secret not in Path(f"/proc/{trainer.pid}/environ").read_text(errors="replace"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code = (
            "import glob, os\n"
            "print('ENV', any(v for v in os.environ.values() if 's3cret' in v))\n"
            "print('KEYS', sorted(k for k in os.environ if 'SECRET' in k or 'KEY' in k))\n"
            f"for pid in ({trainer.pid}, {os.getpid()}):\n"
            "    try:\n"
            "        print('READ', open(f'/proc/{pid}/environ').read())\n"
            "    except OSError as e:\n"
            "        print('denied', pid, type(e).__name__)\n"
            "for path in glob.glob('/proc/*/environ'):\n"
            "    try:\n"
            "        print('SCAN', open(path).read())\n"
            "    except OSError:\n"
            "        pass\n"
            "print('PIDS', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
        r = run(sandbox, code)
    finally:
        trainer.kill()
        trainer.wait()
    assert r.ok, r
    assert secret not in r.stdout and "s3cret" not in r.stdout
    assert "ENV False" in r.stdout and "KEYS []" in r.stdout
    assert f"denied {trainer.pid} FileNotFoundError" in r.stdout
    assert f"denied {os.getpid()} FileNotFoundError" in r.stdout
    pids = eval(r.stdout.split("PIDS ")[1])  # noqa: S307 - a list literal we printed
    assert max(pids) < 10  # a fresh PID namespace: only the launcher and the snippet


def test_sandbox_socket_to_loopback_listener_fails_no_network(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
        r = run(sandbox, code)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert r.error == "exit code 1", r
    assert "Network is unreachable" in r.stderr or "Connection refused" in r.stderr


def test_sandbox_printing_100mb_output_limit_truncated(sandbox):
    r = run(sandbox, "import sys\nsys.stdout.write('x' * (100 * 1024 * 1024))")
    assert r.error == "output limit", r
    assert r.stdout_truncated and len(r.stdout) == CAP and set(r.stdout) == {"x"}


def test_sandbox_reward_helper_passes_correct_and_fails_wrong_code(sandbox):
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"

    async def main():
        return await asyncio.gather(
            run_tests_against("def add(a, b):\n    return a + b\n", tests, sandbox),
            run_tests_against("def add(a, b):\n    return a - b\n", tests, sandbox),
            run_tests_against("import sys\nsys.exit(0)\ndef add(a, b): pass\n", tests, sandbox),
            run_tests_against("while True: pass\n", tests, sandbox),
        )

    right, wrong, early_exit, loop = asyncio.run(main())
    assert run_tests_against_sync("def add(a, b):\n    return b + a\n", tests, sandbox).passed
    assert right.passed and right.result.error is None
    assert not wrong.passed and wrong.result.error == "exit code 1"
    assert "AssertionError" in wrong.result.stderr
    assert not early_exit.passed and early_exit.result.error is None
    assert not loop.passed and loop.result.error == "cpu time limit"


def test_sandbox_python_tool_text_for_agent(sandbox):
    tool = PythonTool(sandbox)
    assert tool.schema["function"]["name"] == "python"
    ok, failed = asyncio.run(
        _gather(tool(code="print(sum(range(10)))"), tool(code="bytearray(10 * 1024**3)"))
    )
    assert ok == "45\n"
    assert failed.startswith("Error: memory limit") and "MemoryError" in failed


async def _gather(*aws):
    return await asyncio.gather(*aws)


def test_sandbox_concurrent_runs_do_not_block_event_loop(sandbox):
    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        code = "import time\ntime.sleep(0.5)\nprint({i})"
        results = await asyncio.gather(*(sandbox.run_python(code.format(i=i)) for i in range(4)))
        stop.set()
        await t
        return results, ticks

    results, ticks = asyncio.run(main())
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert all(r.error is None for r in results)
    assert ticks >= 20  # the loop kept running while four snippets slept


def test_sandbox_hidden_paths_not_visible_built_inside_event_loop():
    hidden = Path(f"/var/tmp/areal-sandbox-hidden-{uuid.uuid4().hex}")
    hidden.mkdir(mode=0o755)
    (hidden / "token").write_text("hf_secret")
    (hidden / "token").chmod(0o644)
    code = f"import os\nprint(os.listdir({str(hidden)!r}))"
    config = dict(wall_time_s=30, cpu_time_s=2)

    async def main():  # built inside a coroutine, as a workflow would
        shown = Sandbox(SandboxConfig(**config))
        hide = (*SandboxConfig().hidden_paths, str(hidden))
        covered = Sandbox(SandboxConfig(hidden_paths=hide, **config))
        return await asyncio.gather(shown.run_python(code), covered.run_python(code))

    try:
        shown, covered = asyncio.run(main())
    finally:
        (hidden / "token").unlink()
        hidden.rmdir()
    assert shown.stdout == "['token']\n"  # the control: visible unless hidden
    assert covered.ok and covered.stdout == "[]\n", covered


def test_sandbox_missing_unshare_refuses_with_clear_message():
    with pytest.raises(SandboxUnavailableError, match="not found") as info:
        Sandbox(SandboxConfig(unshare_binary="/nonexistent/unshare"))
    assert "never run unconfined" in str(info.value)
    assert "unprivileged_userns_clone" in str(info.value)


def test_sandbox_namespaces_denied_refuses_with_clear_message(tmp_path):
    fake = tmp_path / "unshare"
    fake.write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailableError) as info:
        Sandbox(SandboxConfig(unshare_binary=str(fake)))
    message = str(info.value)
    assert "cannot start a confined snippet" in message
    assert "Operation not permitted" in message and "--privileged" in message


def test_sandbox_config_rejects_root_uid():
    with pytest.raises(ValueError, match="uid"):
        SandboxConfig(uid=0)
