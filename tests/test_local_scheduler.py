"""LocalScheduler with real worker processes: health, env, RPC, dead workers, teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from _proc_helpers import leftover_children, now_minus

from areal.api.scheduler_api import Job, RemoteCallError, SchedulingSpec, WorkerDiedError
from areal.infra.rpc.client import RPCClient
from areal.infra.scheduler import LocalScheduler

ECHO = "tests._rpc_engines.EchoEngine"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_FIXTURE_PIDS: set[int] = set()  # workers of the module fixture, alive during other tests


_TEST_START = [0.0]


@pytest.fixture(autouse=True)
def _record_test_start():
    """Children that existed before the test (other modules' fixtures, e.g. Slurm daemons) are not its leftovers."""
    _TEST_START[0] = now_minus(0.5)
    yield


def _assert_no_children():
    kids = leftover_children(since=_TEST_START[0], exclude_pids=_FIXTURE_PIDS)
    assert not kids, f"leftover child processes: {[(c.pid, c.cmdline()) for c in kids]}"


@pytest.fixture(scope="module")
def sched2(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    sched = LocalScheduler(
        fileroot=str(root), experiment_name="exp", trial_name="t1", startup_timeout=120
    )
    try:
        sched.create_workers(Job(replicas=2, role="echo"))
        for w in sched.get_workers("echo"):
            sched.create_engine(w.id, ECHO, scale=2.0)
        _FIXTURE_PIDS.update(sched.worker_pids())
        yield sched
    finally:
        sched.close()
        _FIXTURE_PIDS.clear()
    _assert_no_children()


def test_create_workers_two_rpc_workers_healthy_with_dist_env(sched2):
    workers = sched2.get_workers("echo")
    assert [w.id for w in workers] == ["echo/0", "echo/1"]
    for w in workers:
        assert RPCClient(w.address).health()["status"] == "ok"
    envs = [
        {
            k: sched2.call_engine(w.id, "env", k)
            for k in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMP_NUM_THREADS",
            )
        }
        for w in workers
    ]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] == workers[0].worker_ports[1]
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert sched2.call_engine(workers[0].id, "num_threads") == 1
    log = os.path.join(sched2.fileroot, "logs", "exp", "t1", "echo-1.log")
    assert os.path.exists(log) and sched2.log_path("echo/1") == log
    assert sched2.name_resolve.get("exp/t1/workers/echo/1") == workers[1].address


def test_call_engine_tensor_roundtrip_returns_result(sched2):
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out = sched2.call_engine("echo/1", "add", x, y=y)
    torch.testing.assert_close(out, (x + y) * 2.0)


def test_call_engine_method_raises_remote_error_with_traceback(sched2):
    with pytest.raises(RemoteCallError) as ei:
        sched2.call_engine("echo/0", "fail", "bad input 42")
    msg = str(ei.value)
    assert isinstance(ei.value, RuntimeError)
    assert "echo/0" in msg and "fail" in msg and "ValueError" in msg and "bad input 42" in msg
    assert "_rpc_engines.py" in msg and "Traceback" in msg
    # the worker survives a failing method
    assert sched2.call_engine("echo/0", "add", torch.ones(1), torch.ones(1)).item() == 4.0


def test_call_engine_killed_worker_fails_fast_naming_worker_and_log_tail(tmp_path):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=120, monitor_interval=0.2) as sched:
        sched.create_workers(Job(replicas=2, role="victim"))
        w = sched.get_workers("victim")[1]
        sched.create_engine(w.id, ECHO)
        pid = sched.call_engine(w.id, "pid")
        os.kill(pid, signal.SIGKILL)
        answered = 0
        with pytest.raises(WorkerDiedError) as ei:
            for _ in range(50):  # the first call may race the kill; it must fail within a few calls
                sched.call_engine(w.id, "pid", timeout=10)
                answered += 1
                time.sleep(0.05)
        assert answered <= 3  # a bound on calls, not on seconds
        msg = str(ei.value)
        assert (
            "victim/1" in msg and "role=victim" in msg and "index=1" in msg and f"pid={pid}" in msg
        )
        assert "exit code -9" in msg
        assert "RPC worker pid" in msg  # a line of the worker's own log
        with pytest.raises(WorkerDiedError):
            sched.get_workers("victim")
    _assert_no_children()


def test_call_engine_worker_dies_during_call_raises_without_waiting(tmp_path):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=120) as sched:
        sched.create_workers(Job(replicas=1, role="sleeper"))
        sched.create_engine("sleeper/0", ECHO)
        pid = sched.call_engine("sleeper/0", "pid")
        killer = subprocess.Popen(
            [sys.executable, "-c", f"import os,time; time.sleep(1.0); os.kill({pid}, 9)"]
        )
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="during sleep"):
            sched.call_engine("sleeper/0", "sleep", 60)
        # not the 60 s the call asked for (a generous bound: half of it)
        assert time.monotonic() - t0 < 30
        killer.wait(timeout=10)
    _assert_no_children()


def test_delete_workers_processes_gone_no_children(tmp_path):
    sched = LocalScheduler(fileroot=str(tmp_path), startup_timeout=120)
    try:
        sched.create_workers(Job(replicas=2, role="a"))
        pids = sched.worker_pids("a")
        assert all(_alive(p) for p in pids)
        sched.delete_workers("a")
        assert not any(_alive(p) for p in pids)
        sched.delete_workers("a")  # idempotent
        with pytest.raises(KeyError):
            sched.get_workers("a")
    finally:
        sched.close()
    _assert_no_children()


def test_create_workers_command_worker_serves_and_stops(tmp_path):
    spec = SchedulingSpec(cmd="python -m http.server {port} --bind 127.0.0.1", port_count=1)
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        ids = sched.create_workers(Job(replicas=1, role="srv", tasks=[spec], health_path="/"))
        assert ids == ["srv/0"]
        w = sched.get_workers("srv")[0]
        import requests

        assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
        with pytest.raises(ValueError, match="not an RPC server"):
            sched.call_engine("srv/0", "anything")
        pid = sched.worker_pids("srv")[0]
    assert not _alive(pid)
    _assert_no_children()


def _dying_command(message: str, code: int, delay_s: float = 0.0) -> SchedulingSpec:
    """A command worker that prints ``message`` and exits with ``code`` after ``delay_s``."""
    script = f"import sys, time; time.sleep({delay_s}); print({message!r}); sys.exit({code})"
    return SchedulingSpec(cmd=f'python -c "{script}"', port_count=1)


def test_create_workers_command_exits_at_startup_raises_with_log(tmp_path):
    spec = _dying_command("bad config value", 3)
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        with pytest.raises(WorkerDiedError) as ei:
            sched.create_workers(Job(replicas=1, role="broken", tasks=[spec]))
        assert "broken/0" in str(ei.value) and "exit code 3" in str(ei.value)
        assert "bad config value" in str(ei.value)
        with pytest.raises(KeyError):
            sched.get_workers("broken")
    _assert_no_children()


@pytest.mark.slow
def test_create_workers_no_wait_returns_before_healthy_and_get_workers_waits(tmp_path):
    """``wait=False``: the call returns while the worker still sleeps before serving; a
    second role starts meanwhile; ``get_workers`` (and ``wait_workers`` from two threads)
    wait until it serves."""
    import threading

    import requests

    # "slow" serves only once the test opens its gate (a file): no timing involved
    gate = tmp_path / "gate"
    slow = SchedulingSpec(
        cmd='python -c "import os, time, http.server as h; '
        f"[time.sleep(0.05) for _ in iter(lambda: os.path.exists('{gate}'), True)]; "
        "h.test(HandlerClass=h.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')\"",
        port_count=1,
    )
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        # returns with the gate closed: it did not wait for the worker to serve
        ids = sched.create_workers(
            Job(replicas=1, role="slow", tasks=[slow], health_path="/"), wait=False
        )
        assert ids == ["slow/0"]
        sched.create_workers(Job(replicas=1, role="rpc"))  # started while "slow" boots
        errors: list[BaseException] = []

        def wait():
            try:
                sched.wait_workers("slow")
            except BaseException as e:  # noqa: BLE001 - collected for the assert
                errors.append(e)

        threads = [threading.Thread(target=wait) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert all(t.is_alive() for t in threads) and not errors  # waiting: the gate is shut
        gate.touch()
        (w,) = sched.get_workers("slow")
        assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
        for t in threads:
            t.join(30)
        assert not errors
        sched.wait_workers("slow")  # already waited for: returns at once
    _assert_no_children()


def test_create_workers_no_wait_failed_start_raised_to_every_waiter(tmp_path):
    spec = _dying_command("bad config value", 3, delay_s=1.0)
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        assert sched.create_workers(Job(replicas=1, role="broken", tasks=[spec]), wait=False)
        with pytest.raises(WorkerDiedError, match="bad config value"):
            sched.get_workers("broken")
        assert sched.worker_pids("broken") == []  # the role was stopped
        with pytest.raises(KeyError):
            sched.get_workers("broken")
    _assert_no_children()


def test_workers_exit_when_controller_killed(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from areal.api.scheduler_api import Job, SchedulingSpec
        from areal.infra.scheduler import LocalScheduler
        s = LocalScheduler(fileroot={str(tmp_path)!r}, startup_timeout=120)
        s.create_workers(Job(replicas=1, role="rpc"))
        s.create_workers(Job(replicas=1, role="cmd", tasks=[SchedulingSpec(cmd="python -m http.server {{port}} --bind 127.0.0.1", port_count=1)], health_path="/"))
        print(" ".join(str(p) for p in s.worker_pids()), flush=True)
        time.sleep(120)
        """
    )
    ctrl = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = ctrl.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        ctrl.kill()
        ctrl.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        if ctrl.poll() is None:
            ctrl.kill()
            ctrl.wait(timeout=10)
        for p in pids if "pids" in dir() else []:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_name_resolve_file_backend_add_replace_wait_subtree(tmp_path):
    from areal.utils.name_resolve import (
        FileNameRecordRepository,
        NameEntryExistsError,
        NameEntryNotFoundError,
    )

    repo = FileNameRecordRepository(str(tmp_path / "nr"))
    repo.add("e/t/workers/actor/0", "127.0.0.1:1")
    with pytest.raises(NameEntryExistsError):
        repo.add("e/t/workers/actor/0", "x")
    repo.add("e/t/workers/actor/0", "127.0.0.1:2", replace=True)
    repo.add("e/t/workers/actor/1", "127.0.0.1:3")
    assert repo.get("e/t/workers/actor/0") == "127.0.0.1:2"
    assert repo.get_subtree("e/t/workers/actor") == ["127.0.0.1:2", "127.0.0.1:3"]
    assert not [f for f in os.listdir(tmp_path / "nr/e/t/workers/actor/0") if f.startswith(".tmp")]
    with pytest.raises(TimeoutError, match="missing"):
        repo.wait("e/t/missing", timeout=0.2)
    repo.delete("e/t/workers/actor/1")
    with pytest.raises(NameEntryNotFoundError):
        repo.get("e/t/workers/actor/1")
    with pytest.raises(ValueError):
        repo.add("../escape", "x")


@pytest.mark.parametrize(
    "cmd", ["python3 -m areal.infra.rpc.rpc_server", "python -m areal.infra.rpc.rpc_server"]
)
def test_areal_rpc_server_cmd_in_spec_reads_as_rpc_worker(cmd):
    """AReaL YAMLs spell the RPC worker as a command; the scheduler appends the port."""
    job = Job(replicas=1, tasks=[SchedulingSpec(cpu=1, mem=1, cmd=cmd)], role="actor")
    assert job.worker_spec.cmd is None and job.tasks[0].cmd == cmd
    other = Job(tasks=[SchedulingSpec(cmd="python -m areal.infra.rpc.rpc_server --port {port}")])
    assert other.worker_spec.cmd is not None


def test_areal_rpc_server_cmd_worker_starts_and_answers(tmp_path):
    sched = LocalScheduler(fileroot=str(tmp_path), experiment_name="e", trial_name="t")
    try:
        spec = SchedulingSpec(cpu=1, mem=1, cmd="python3 -m areal.infra.rpc.rpc_server")
        sched.create_workers(Job(replicas=1, tasks=[spec], role="w"))
        (w,) = sched.get_workers("w")
        assert RPCClient(w.address, worker_id=w.id).health()
    finally:
        sched.delete_workers(None)


def _taken_first(sched, monkeypatch):
    """Make the scheduler's first port allocation return a port another socket listens on
    (the race between ``find_free_ports`` and the worker's bind, made certain)."""
    import socket

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real = sched._allocate_ports
    calls = []

    def allocate(n):
        calls.append(n)
        ports = real(n)
        return [taken] + ports[1:] if len(calls) == 1 else ports

    monkeypatch.setattr(sched, "_allocate_ports", allocate)
    return holder, taken


def test_rpc_worker_whose_port_was_taken_starts_again_on_a_new_port(tmp_path, monkeypatch):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=120) as sched:
        holder, taken = _taken_first(sched, monkeypatch)
        try:
            sched.create_workers(Job(replicas=2, role="rpc"))
            w0, w1 = sched.get_workers("rpc")
            sched.create_engine(w1.id, ECHO, scale=1.0)
            assert int(w0.worker_ports[0]) != taken
            assert RPCClient(w0.address).health()["status"] == "ok"
            # rank 0 kept its second port: MASTER_PORT the other rank was given
            assert sched.call_engine(w1.id, "env", "MASTER_PORT") == w0.worker_ports[1]
            assert sched.name_resolve.get(sched._key("rpc", 0)) == w0.address
            log = open(sched.log_path("rpc/0")).read()
            assert "start (port taken)" in log and "already in use" in log.lower()
        finally:
            holder.close()
    _assert_no_children()


def test_command_worker_whose_port_was_taken_starts_again_on_a_new_port(tmp_path, monkeypatch):
    spec = SchedulingSpec(cmd="python -m http.server {port} --bind 127.0.0.1", port_count=1)
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        holder, taken = _taken_first(sched, monkeypatch)
        try:
            sched.create_workers(Job(replicas=1, role="srv", tasks=[spec], health_path="/"))
            (w,) = sched.get_workers("srv")
            assert int(w.worker_ports[0]) != taken
            import requests

            assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
        finally:
            holder.close()
    _assert_no_children()


def test_worker_dying_for_another_reason_is_not_started_again(tmp_path):
    spec = _dying_command("OSError: something else", 1)
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        with pytest.raises(WorkerDiedError, match="something else"):
            sched.create_workers(Job(replicas=1, role="broken", tasks=[spec]))
        log = open(os.path.join(sched.log_dir, "broken-0.log")).read()
        assert log.count("===== ") == 1
    _assert_no_children()
