"""Hung inference servers (alive but silent: SIGSTOP) with real server processes.

- ``RemoteInfEngine`` health deadlines: a SIGSTOPped server is declared hung within
  ``health_check_timeout``; the requests waiting on it move to the other server and finish
  with exactly the tokens of an undisturbed run (greedy: nothing lost, nothing twice);
- a weight update does not wait for a hung server (it is left out, not waited for);
- ``ServerWatchdog`` replaces the hung server (SIGKILL + restart) in the background: its
  ``check()`` returns while the restart is still blocked, rollout continues on the healthy
  server meanwhile, and the restarted server is readmitted at the current version;
- a dropped connection to a server that still answers its health probe is retried
  beyond ``request_retries`` (the soak's ``dropped_connection`` fault);
- a live server taken out of rotation for a transient error is readmitted with the
  weights it missed, without a restart;
- ``areal.infra.wait_log``: a long wait logs what it waits for, rate-limited.

No timing races: restarts are held by a gate the test opens, and everything else is polled
with deadlines.
"""

from __future__ import annotations

import asyncio
import logging as std_logging
import os
import signal
import threading
import time

import psutil
import pytest
import requests
from conftest import build_tiny_qwen2

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.api.scheduler_api import Job, SchedulingSpec
from areal.infra.scheduler.local import LocalScheduler
from areal.infra.wait_log import WaitLog, waiting

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = pytest.mark.serial

N_NEW = 48


def _poll(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _GatedScheduler:
    """The real scheduler, with ``restart_worker`` held until ``gate`` is set."""

    def __init__(self, sched: LocalScheduler):
        self.sched = sched
        self.gate = threading.Event()
        self.entered = threading.Event()

    def restart_worker(self, wid: str):
        self.entered.set()
        assert self.gate.wait(120), "test never opened the restart gate"
        return self.sched.restart_worker(wid)

    def __getattr__(self, name):
        return getattr(self.sched, name)


def _request(prompt: list[int]) -> ModelRequest:
    return ModelRequest(
        input_ids=prompt,
        gconfig=GenerationHyperparameters(max_new_tokens=N_NEW, greedy=True, ignore_eos=True),
    )


def _generate(eng, prompts: list[list[int]]) -> list[list[int]]:
    async def _all():
        return await asyncio.gather(*(eng.agenerate(_request(p)) for p in prompts))

    return [r.output_tokens for r in asyncio.run(_all())]


@pytest.fixture
def two_servers(tmp_path):
    """(scheduler, engine, addresses, model dir): two built-in servers of a tiny model."""
    from areal.inference.clients.local import RemoteLocalEngine

    model = build_tiny_qwen2(str(tmp_path / "model"), seed=0)
    cmd = f"python -m areal.inference.server --model-path {model} --host {{host}} --port {{port}}"
    spec = SchedulingSpec(cmd=cmd, port_count=1, env_vars={"OMP_NUM_THREADS": "1"})
    job = Job(
        replicas=2, role="rollout", tasks=[spec], health_path="/health", distributed_env=False
    )
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=120) as sched:
        sched.create_workers(job)
        addrs = [w.address for w in sched.get_workers("rollout")]
        eng = RemoteLocalEngine(
            InferenceEngineConfig(
                setup_timeout=60,
                request_timeout=600,  # a hung server must be noticed long before this
                health_check_interval=0.2,
                health_check_timeout=2.0,
            )
        )
        eng.initialize(addrs)
        stopped: list[int] = []
        try:
            yield sched, eng, addrs, model, stopped
        finally:
            for pid in stopped:  # never leave a stopped process behind
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            eng.destroy()


@pytest.mark.slow
def test_sigstopped_server_hung_requests_move_and_watchdog_replaces_it_in_background(
    two_servers,
):
    from areal.infra.server_watchdog import ServerWatchdog

    sched, eng, addrs, _, stopped = two_servers
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    reference = _generate(eng, prompts)
    assert all(len(t) == N_NEW for t in reference)
    gated = _GatedScheduler(sched)
    dog = ServerWatchdog(gated, eng, weight_update_meta=None)
    old_pid = sched.worker_pids("rollout")[1]

    os.kill(old_pid, signal.SIGSTOP)  # alive but silent
    stopped.append(old_pid)
    got = _generate(eng, prompts)  # half of them are sent to the stopped server first

    assert got == reference  # every request finished, no token lost or generated twice
    assert eng.requests_moved >= 1
    assert eng.hung_addresses == [addrs[1]]
    assert eng.healthy_addresses == [addrs[0]]

    t0 = time.monotonic()
    assert dog.check() == 0  # returns at once: the restart runs in the background
    assert time.monotonic() - t0 < 5
    _poll(gated.entered.is_set, 30, "the background restart to start")
    assert dog.restarting == ["rollout/1"]
    assert sched.dead_workers("rollout") == ["rollout/1"]  # the hung process was killed
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == "zombie"
    # rollout continues on the healthy server while the restart is held
    assert _generate(eng, prompts[:2]) == reference[:2]
    assert dog.restarting == ["rollout/1"]

    gated.gate.set()
    dog.wait_restarts(120)
    assert dog.check() == 1
    assert dog.restarting == []
    assert sorted(eng.healthy_addresses) == sorted(addrs)  # same port again
    assert eng.hung_addresses == []
    assert sched.worker_pids("rollout")[1] != old_pid
    stats = dog.step_stats()
    assert stats["rollout/server_restarts"] == 1.0
    assert stats["rollout/servers_hung_total"] == 1.0
    assert stats["rollout/server_restart_background_seconds"] > 0
    eng.exclude_server(addrs[0], "test: route to the restarted server")
    assert _generate(eng, prompts[:3]) == reference[:3]


@pytest.mark.slow
def test_weight_update_leaves_out_hung_server_instead_of_waiting(two_servers, tmp_path):
    sched, eng, addrs, _, stopped = two_servers
    meta = WeightUpdateMeta.from_disk("exp", "trial", str(tmp_path))
    build_tiny_qwen2(meta.with_version(1).path, seed=1)
    pid = sched.worker_pids("rollout")[1]
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)

    t0 = time.monotonic()
    eng.update_weights_from_disk(meta.with_version(1)).result(timeout=120)
    assert eng.commit_weights(1) == []  # the load is pending until the commit

    assert time.monotonic() - t0 < 60  # bounded by the health deadline, not request_timeout
    assert eng.hung_addresses == [addrs[1]]
    assert requests.get(f"http://{addrs[0]}/version", timeout=5).json()["version"] == 1
    assert eng.get_version() == 1


@pytest.mark.slow
def test_live_server_out_of_rotation_readmitted_with_missed_weights_without_restart(
    two_servers, tmp_path
):
    """A server taken out for a transient error (e.g. a dropped connection during a weight
    update) whose process lives and answers is readmitted with the weights it missed."""
    from areal.infra.server_watchdog import ServerWatchdog

    sched, eng, addrs, _, _ = two_servers
    meta = WeightUpdateMeta.from_disk("exp", "trial", str(tmp_path))
    build_tiny_qwen2(meta.with_version(1).path, seed=1)
    dog = ServerWatchdog(sched, eng, weight_update_meta=meta)
    pid = sched.worker_pids("rollout")[1]
    eng.exclude_server(addrs[1], "test: connection dropped during a weight update")
    eng.update_weights_from_disk(meta.with_version(1)).result(timeout=120)
    assert eng.commit_weights(1) == []  # WeightSynchronizer's commit: addrs[0] only
    assert requests.get(f"http://{addrs[1]}/version", timeout=5).json()["version"] == 0

    assert dog.check() == 0
    dog.wait_restarts(120)
    assert dog.check() == 1

    assert sorted(eng.healthy_addresses) == sorted(addrs)
    assert requests.get(f"http://{addrs[1]}/version", timeout=5).json()["version"] == 1
    assert sched.worker_pids("rollout")[1] == pid  # the same process: no restart
    stats = dog.step_stats()
    assert stats["rollout/server_readmits_total"] == 1.0
    assert stats["rollout/server_restarts_total"] == 0.0


@pytest.fixture
def dropping_server():
    """A real HTTP server on 127.0.0.1 speaking the built-in backend's protocol whose
    ``/generate`` drops (resets) the connection the first ``drops`` times."""
    from aiohttp import web

    from areal.utils.network import find_free_ports

    state = {"drops": 5, "calls": 0, "control_drops": 0, "control_calls": 0}

    async def control(request):  # /pause, /continue: drop the first ``control_drops``
        state["control_calls"] += 1
        if state["control_calls"] <= state["control_drops"]:
            request.transport.abort()
            return web.Response()
        return web.json_response({"ok": True})

    async def health(request):
        return web.json_response({"status": "ok", "version": 0})

    async def generate(request):
        body = await request.json()
        state["calls"] += 1
        if state["calls"] <= state["drops"]:
            request.transport.abort()  # connection reset mid-request
            return web.Response()
        n = body["sampling_params"]["max_new_tokens"]
        return web.json_response(
            {
                "output_ids": list(range(n)),
                "output_logprobs": [-1.0] * n,
                "output_versions": [0] * n,
                "finish_reason": {"type": "length"},
            }
        )

    port = find_free_ports(1)[0]
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.post("/generate", generate),
            web.post("/pause", control),
            web.post("/continue", control),
        ]
    )
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}", state
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_dropped_connections_retried_beyond_request_retries_server_stays(dropping_server):
    from areal.inference.clients.local import RemoteLocalEngine

    addr, state = dropping_server
    eng = RemoteLocalEngine(
        InferenceEngineConfig(setup_timeout=30, request_timeout=60, request_retries=1)
    )
    eng.initialize([addr])
    try:
        out = _generate(eng, [[1, 2, 3]])
    finally:
        eng.destroy()
    assert out == [list(range(N_NEW))]  # one answer: nothing lost, nothing twice
    assert state["calls"] == state["drops"] + 1  # 5 drops > request_retries=1
    assert eng.healthy_addresses == [addr]  # it answers its health probe: it stays


@pytest.mark.parametrize("drops", [1, 2])
def test_dropped_connection_on_continue_retried_once_server_stays(dropping_server, drops):
    """A dropped connection during ``/continue`` (the chaos soak's one unplanned exit: every
    server left the rotation) is retried once when the server still answers its probe."""
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.infra.remote_inf_engine import NoHealthyServerError

    addr, state = dropping_server
    state["control_drops"] = drops
    eng = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=30, request_timeout=30))
    eng.initialize([addr])
    try:
        if drops == 1:
            eng.continue_generation()
            assert eng.healthy_addresses == [addr]
        else:  # dropped again on the retry: the server leaves the rotation, as before
            with pytest.raises(NoHealthyServerError):
                eng.continue_generation()
            assert eng.healthy_addresses == []
    finally:
        eng.destroy()
    assert state["control_calls"] == 2  # the call and exactly one retry


def test_wait_log_rate_limited_and_names_what_it_waits_for(caplog):
    logger = std_logging.getLogger("test_wait_log")
    log = WaitLog(logger, every=10.0, first_after=0.0)
    with caplog.at_level(std_logging.WARNING, logger="test_wait_log"):
        assert log.tick(lambda: "server 127.0.0.1:1 (3 in flight)")
        assert not log.tick("again at once")  # rate-limited
        log._next = time.monotonic()  # the next line is due
        assert log.tick("server 127.0.0.1:2")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "still waiting" in lines[0] and "127.0.0.1:1 (3 in flight)" in lines[0]


def test_waiting_context_logs_while_blocked_and_stops_after(caplog):
    logger = std_logging.getLogger("test_waiting")
    released = threading.Event()
    with caplog.at_level(std_logging.WARNING, logger="test_waiting"):
        with waiting(logger, lambda: "rpc 'train_batch' on actor/0", every=0.05, first_after=0):
            _poll(lambda: len(caplog.records) >= 2, 10, "two wait log lines")
            released.set()
        n = len(caplog.records)
        time.sleep(0.2)  # nothing may be logged once the block has exited
        assert len(caplog.records) == n
    assert all("rpc 'train_batch' on actor/0" in r.getMessage() for r in caplog.records)


def test_cycle_dataloader_restored_at_epoch_end_continues_with_next_epoch():
    """Found by the chaos soak: a recover checkpoint taken after the last batch of an epoch
    was drawn restores a loader whose first pass is empty; the run must go on with the next
    epoch, not fail with 'the dataloader yielded no batch' on every relaunch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from areal.infra.rollout.rollout_submission import cycle_dataloader

    rows = [{"i": i} for i in range(8)]
    first = StatefulDataLoader(rows, batch_size=4, collate_fn=lambda b: b)
    it = iter(first)
    next(it), next(it)  # the whole epoch drawn
    state = first.state_dict()
    restored = StatefulDataLoader(rows, batch_size=4, collate_fn=lambda b: b)
    restored.load_state_dict(state)

    cyc = cycle_dataloader(restored)
    got = [next(cyc) for _ in range(2)]

    assert [r["i"] for b in got for r in b] == list(range(8))  # the next epoch, in full
    with pytest.raises(ValueError, match="yielded no batch"):
        next(cycle_dataloader(StatefulDataLoader([], batch_size=4, collate_fn=lambda b: b)))
