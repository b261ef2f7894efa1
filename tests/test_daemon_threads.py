"""``spawn_daemon``: calls run on reused daemon threads, never wait for one another, and
parked threads leave after ``IDLE_EXIT_S``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from areal.infra.daemon_threads import spawn_daemon


def test_calls_one_after_another_reuse_one_thread():
    spawn_daemon(lambda: None).result(timeout=10)  # one parked thread at least
    idents = [spawn_daemon(threading.get_ident).result(timeout=10) for _ in range(20)]
    assert len(set(idents)) < 20  # reused, not a thread per call
    assert all(i != threading.get_ident() for i in idents)
    assert all(t.daemon for t in threading.enumerate() if t.ident in set(idents))


def test_blocked_calls_do_not_hold_up_others_and_results_and_errors_come_back():
    release = threading.Event()
    barrier = threading.Barrier(12)
    # twelve calls that each wait for all twelve: they finish only if each got a thread
    futs = [spawn_daemon(barrier.wait, timeout=20) for _ in range(12)]
    hung = spawn_daemon(release.wait, name="hung-call")
    assert sorted(f.result(timeout=30) for f in futs) == list(range(12))
    assert spawn_daemon(lambda a, b=0: a + b, 2, b=3).result(timeout=10) == 5

    def boom():
        raise KeyError("lost")

    with pytest.raises(KeyError, match="lost"):
        spawn_daemon(boom).result(timeout=10)
    names = {t.name for t in threading.enumerate()}
    assert "hung-call" in names  # a running call carries its caller's name
    assert not hung.done()
    release.set()
    assert hung.result(timeout=10) is True


def test_parked_threads_exit_after_idle_timeout():
    code = textwrap.dedent(
        """
        import threading, time
        from areal.infra import daemon_threads as d
        d.IDLE_EXIT_S = 0.3
        barrier = threading.Barrier(5)
        futs = [d.spawn_daemon(barrier.wait, timeout=20) for _ in range(5)]
        [f.result(timeout=20) for f in futs]
        time.sleep(0.1)
        busy = d.idle_threads()
        time.sleep(1.5)
        alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
        print(busy, d.idle_threads(), len(alive))
        print(d.spawn_daemon(lambda: 7).result(timeout=10))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["5", "0", "0", "7"]  # 5 parked, all gone, and a new call still runs
