"""The trainer hands its idle cores to the built-in servers of its machine
(``areal.trainer.cpu_handoff``), against a real server on 127.0.0.1."""

from __future__ import annotations

import pytest
import requests
from _local_engine import local_engine

from areal.trainer.cpu_handoff import CpuThreadHandoff
from areal.utils.auth import auth_headers, get_run_secret

CTL = requests.Session()
CTL.headers.update(auth_headers(get_run_secret()))


def _threads(addr: str) -> int:
    return requests.get(f"http://{addr}/metrics", timeout=10).json()["cpu_threads"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with local_engine(tiny_model_dir) as eng:
        yield eng


def test_set_cpu_threads_endpoint_sets_threads_and_refuses_bad_counts(engine):
    addr = engine.healthy_addresses[0]
    assert _threads(addr) == 1  # launched with one thread
    r = CTL.post(f"http://{addr}/set_cpu_threads", json={"threads": 2}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["previous"] == 1 and _threads(addr) == 2
    # a state-changing endpoint: refused without the run secret
    r = requests.post(f"http://{addr}/set_cpu_threads", json={"threads": 1}, timeout=10)
    assert r.status_code in (401, 403) and _threads(addr) == 2
    for bad in (0, 10_000, "2", True):
        r = CTL.post(f"http://{addr}/set_cpu_threads", json={"threads": bad}, timeout=10)
        assert r.status_code == 400 and "threads=" in r.text, (bad, r.text)
    assert _threads(addr) == 2
    # the server still generates, greedy output unchanged by the thread count
    out2 = engine_generate(addr)
    CTL.post(f"http://{addr}/set_cpu_threads", json={"threads": 1}, timeout=10)
    assert _threads(addr) == 1 and engine_generate(addr) == out2


def engine_generate(addr: str) -> list[int]:
    r = CTL.post(
        f"http://{addr}/generate",
        json={"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "greedy": True}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_handoff_gives_servers_the_cores_while_waiting_and_one_thread_after(engine):
    addr = engine.healthy_addresses[0]
    handoff = CpuThreadHandoff(engine, enabled=True, cpus=2)
    assert handoff.enabled and handoff.idle_threads == 2
    with handoff.waiting():
        assert _threads(addr) == 2
    assert _threads(addr) == 1
    with pytest.raises(RuntimeError, match="boom"), handoff.waiting():
        assert _threads(addr) == 2
        raise RuntimeError("boom")
    assert _threads(addr) == 1  # back to one thread on an error too


def test_handoff_off_when_disabled_or_no_core_to_give(engine):
    addr = engine.healthy_addresses[0]
    for handoff in (
        CpuThreadHandoff(engine, enabled=False, cpus=2),
        CpuThreadHandoff(engine, enabled=True, cpus=1),
    ):
        assert not handoff.enabled
        with handoff.waiting():
            assert _threads(addr) == 1


def test_handoff_off_for_servers_of_another_host():
    class Remote:
        healthy_addresses = ["10.0.0.5:8000"]

        def set_cpu_threads(self, n):  # pragma: no cover - must not be called
            raise AssertionError("called")

    handoff = CpuThreadHandoff(Remote(), enabled=True, cpus=8)
    assert not handoff.enabled
    with handoff.waiting():
        pass
