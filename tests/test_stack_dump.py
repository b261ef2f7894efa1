"""Stack dumps on hung waits: a worker blocked in native code that holds the GIL answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal.infra import stack_dump
from areal.infra.wait_log import WaitLog, waiting
from areal.utils import logging

logger = logging.getLogger("TestStackDump")

# The target: registers the handler, then calls libc's sleep through ctypes.PyDLL, which
# keeps the GIL for the whole call, so no Python thread of this process can run meanwhile.
TARGET = textwrap.dedent(
    """
    import ctypes
    from areal.infra import stack_dump

    stack_dump.install_process_handler("worker")

    def blocked_in_native_sleep():
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL is held during the call
        print("blocked", flush=True)
        while True:
            libc.sleep(1000)

    blocked_in_native_sleep()
    """
)


@pytest.fixture
def dump_dir(tmp_path):
    stack_dump.disable()  # also resets the rate limit between dumps
    stack_dump.enable(str(tmp_path / "stacks"), after_s=2.0)
    yield tmp_path / "stacks"
    stack_dump.disable()


def _start_blocked_worker():
    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET], stdout=subprocess.PIPE, env=dict(os.environ), text=True
    )
    assert proc.stdout.readline().strip() == "blocked"
    return proc


def test_wait_past_deadline_worker_holding_gil_dump_names_blocked_function(dump_dir):
    proc = _start_blocked_worker()
    try:
        t0 = time.monotonic()
        log = WaitLog(logger, every=1.0, first_after=0.5)
        assert log.deadline_s == 2.0
        while log.dump_files is None and time.monotonic() - t0 < 12.0:
            log.tick("the blocked worker")
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert log.dump_files, "no dump within the deadline + 10 s"
        assert took <= 2.0 + 10.0
        worker_file = str(dump_dir / f"worker-{proc.pid}.stacks")
        assert worker_file in log.dump_files
        text = open(worker_file).read()
        assert "blocked_in_native_sleep" in text
        assert "waited" in text and "the blocked worker" in text  # the header names the wait
        assert proc.poll() is None  # the dump did not kill it
    finally:
        proc.kill()
        proc.wait()


def test_waiting_block_past_deadline_dumps_controller_stacks(dump_dir):
    def hung_rpc_call_under_test():
        with waiting(logger, "a hung RPC", every=1.0, first_after=0.5) as log:
            deadline = time.monotonic() + 6.0
            while log.dump_files is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return log

    log = hung_rpc_call_under_test()
    assert log.dump_files
    own = log.dump_files[0]
    assert os.path.basename(own) == f"controller-{os.getpid()}.stacks"
    assert "hung_rpc_call_under_test" in open(own).read()


def test_sigusr1_to_controller_dumps_every_registered_process(dump_dir):
    proc = _start_blocked_worker()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        worker_file = dump_dir / f"worker-{proc.pid}.stacks"
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not (
            worker_file.exists() and "blocked_in_native_sleep" in worker_file.read_text()
        ):
            time.sleep(0.1)
        assert "blocked_in_native_sleep" in worker_file.read_text()
        assert "SIGUSR1" in worker_file.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_no_dump_dir_deadline_is_none_and_bad_deadline_is_refused(monkeypatch):
    monkeypatch.delenv(stack_dump.STACK_DUMP_DIR_ENV, raising=False)
    assert stack_dump.hang_deadline_s() is None
    assert WaitLog(logger).deadline_s is None
    monkeypatch.setenv(stack_dump.STACK_DUMP_DIR_ENV, "/nonexistent-dir")
    monkeypatch.setenv(stack_dump.HANG_DUMP_AFTER_ENV, "soon")
    with pytest.raises(ValueError, match="AREAL_HANG_DUMP_AFTER_S"):
        stack_dump.hang_deadline_s()


def test_rpc_worker_started_after_enable_registers_and_answers_dump(dump_dir):
    from areal.utils.network import find_free_ports

    port = find_free_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal.infra.rpc.rpc_server", "--port", str(port)]
        + ["--insecure-no-auth"],
        env=dict(os.environ),
    )
    try:
        worker_file = dump_dir / f"worker-{proc.pid}.stacks"
        deadline = time.monotonic() + 60.0
        while not worker_file.exists() and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.1)
        files = stack_dump.dump_all("test", force=True)
        assert str(worker_file) in files
        assert "_watch_parent" in worker_file.read_text()  # its parent-watch thread
    finally:
        proc.terminate()
        proc.wait(timeout=30)
