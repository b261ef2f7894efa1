"""Inference-server faults: a server that dies is restarted with the current weights.

- ``LocalScheduler.dead_workers`` / ``restart_worker`` on a plain command worker,
- ``ServerWatchdog`` + ``RemoteLocalEngine`` + built-in servers: a killed server comes
  back serving the weights of the engine's current version,
- the demo controller: ``kill -9`` of one of two servers during training; the run
  finishes every step with full batches, counts the restart and the restarted server
  serves the current weights (server logprobs = trainer logprobs).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests
import torch
from _jsonl import read_jsonl
from conftest import build_tiny_qwen2

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.api.scheduler_api import Job, SchedulingSpec
from areal.infra.scheduler.local import LocalScheduler

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = pytest.mark.serial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "math", "gsm8k_rl.py")
DEMO_YAML = os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml")


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _http_job(role: str = "srv") -> Job:
    spec = SchedulingSpec(cmd="python -m http.server {port} --bind 127.0.0.1", port_count=1)
    return Job(replicas=1, role=role, tasks=[spec], health_path="/", distributed_env=False)


# ---------------------------------------------------------------------------- scheduler


def test_restart_worker_dead_command_worker_same_port_and_log_appended(tmp_path):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        sched.create_workers(_http_job())
        old = sched.get_workers("srv")[0].address
        assert sched.dead_workers("srv") == [] and sched.dead_workers("nope") == []
        with pytest.raises(ValueError, match="alive"):
            sched.restart_worker("srv/0")
        pid = sched.worker_pids("srv")[0]
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: sched.dead_workers("srv") == ["srv/0"], 10, "dead worker")
        assert "exit code -9" in sched.worker_exit_info("srv/0")

        w = sched.restart_worker("srv/0")

        assert w.address == old
        assert sched.dead_workers("srv") == []
        assert sched.worker_pids("srv")[0] != pid
        assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
        assert sched.get_workers("srv")[0].address == old
        log = open(sched.log_path("srv/0")).read()
        assert log.count("===== ") == 2 and " restart: " in log
        new_pid = sched.worker_pids("srv")[0]
    assert not psutil.pid_exists(new_pid) or psutil.Process(new_pid).status() == "zombie"


def test_restart_worker_port_taken_gets_new_port_and_publishes_it(tmp_path):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        sched.create_workers(_http_job())
        old = sched.get_workers("srv")[0].address
        os.kill(sched.worker_pids("srv")[0], signal.SIGKILL)
        _wait(lambda: sched.dead_workers("srv") == ["srv/0"], 10, "dead worker")
        blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # old conns in TIME_WAIT
            blocker.bind(("127.0.0.1", int(old.rpartition(":")[2])))
            blocker.listen(1)
            w = sched.restart_worker("srv/0")
        finally:
            blocker.close()
        assert w.address != old
        assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
        key = f"{sched.experiment_name}/{sched.trial_name}/workers/srv/0"
        assert sched.name_resolve.get(key) == w.address


def test_restart_worker_rpc_worker_raises_value_error(tmp_path):
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        sched.create_workers(Job(replicas=1, role="rpc"))
        os.kill(sched.worker_pids("rpc")[0], signal.SIGKILL)
        _wait(lambda: sched.dead_workers("rpc") == ["rpc/0"], 10, "dead worker")
        with pytest.raises(ValueError, match="RPC worker"):
            sched.restart_worker("rpc/0")


# ---------------------------------------------------------------------------- watchdog


def _hf_logprobs(model_dir, prompt, output):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


@pytest.mark.slow
def test_watchdog_killed_server_restarted_with_current_disk_weights(tmp_path):
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.infra.server_watchdog import ServerWatchdog

    v0 = build_tiny_qwen2(str(tmp_path / "model"), seed=0)
    meta = WeightUpdateMeta.from_disk("exp", "trial", str(tmp_path))
    build_tiny_qwen2(meta.with_version(3).path, seed=1)  # "the trainer's" version 3
    cmd = f"python -m areal.inference.server --model-path {v0} --host {{host}} --port {{port}}"
    spec = SchedulingSpec(cmd=cmd, port_count=1, env_vars={"OMP_NUM_THREADS": "1"})
    job = Job(
        replicas=2, role="rollout", tasks=[spec], health_path="/health", distributed_env=False
    )
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=120) as sched:
        sched.create_workers(job)
        addrs = [w.address for w in sched.get_workers("rollout")]
        eng = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=60, request_timeout=60))
        eng.initialize(addrs)
        try:
            eng.update_weights_from_disk(meta.with_version(3)).result(timeout=60)
            assert eng.commit_weights(3) == []  # pending until the commit (WeightSynchronizer's)
            dog = ServerWatchdog(sched, eng, weight_update_meta=meta)
            assert dog.check() == 0
            os.kill(sched.worker_pids("rollout")[1], signal.SIGKILL)
            _wait(lambda: sched.dead_workers("rollout") == ["rollout/1"], 10, "dead server")

            assert dog.check() == 0  # restart started in the background
            assert dog.restarting == ["rollout/1"]
            dog.wait_restarts(120)
            assert dog.check() == 1

            assert eng.healthy_addresses == addrs
            first, second = dog.step_stats(), dog.step_stats()
            assert first["rollout/server_restarts"] == 1.0
            assert first["rollout/server_restart_seconds"] > 0
            assert first["rollout/server_restart_background_seconds"] > 0
            assert second == {
                "rollout/server_restarts": 0.0,
                "rollout/server_restart_seconds": 0.0,
                "rollout/server_restart_background_seconds": 0.0,
                "rollout/server_restarts_total": 1.0,
                "rollout/servers_hung_total": 0.0,
                "rollout/server_readmits_total": 0.0,
                "rollout/servers_healthy": 2.0,
            }
            r = requests.get(f"http://{addrs[1]}/version", timeout=5).json()
            assert r["version"] == 3
            eng.exclude_server(addrs[0], "test: route to the restarted server")
            prompt = [5, 6, 7]
            req = ModelRequest(
                input_ids=prompt,
                gconfig=GenerationHyperparameters(max_new_tokens=12, greedy=True, ignore_eos=True),
            )
            resp = asyncio.run(eng.agenerate(req))
            assert resp.output_versions == [3] * 12
            torch.testing.assert_close(
                torch.tensor(resp.output_logprobs),
                _hf_logprobs(meta.with_version(3).path, prompt, resp.output_tokens),
                atol=1e-4,
                rtol=0,
            )
        finally:
            eng.destroy()


def test_watchdog_scheduler_without_restart_leaves_server_out():
    from areal.infra.server_watchdog import ServerWatchdog

    class _Engine:
        addresses = ["127.0.0.1:1", "127.0.0.1:2"]
        healthy_addresses = ["127.0.0.1:2"]

    dog = ServerWatchdog(object(), _Engine())
    assert not dog.can_restart
    assert dog.check() == 0
    assert dog._reported_out == {"127.0.0.1:1"}
    assert dog.step_stats()["rollout/servers_healthy"] == 1.0


# ---------------------------------------------------------------------------- end to end


def _cmd(fileroot: str, mode: str = "disk") -> list[str]:
    return [
        sys.executable, SCRIPT, "--config", DEMO_YAML,
        f"cluster.fileroot={fileroot}",
        "total_train_steps=1000",  # stopped by SIGTERM once the restart has been seen
        "allocation_mode=local:d2+fsdp:d1",
        "rollout.max_head_offpolicyness=0",
        "train_dataset.path=synthetic://arith?digits=1&steps=2&n=400&seed=7",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=24",
        "actor.dynamic_sampling=false",
        "valid_dataset=null",
        "recover.mode=disabled",
        f"actor.weight_update_mode={mode}",
        "actor.weight_update_timeout=60",  # a broken xccl sync fails instead of hanging
    ]  # fmt: skip


def _stats(fileroot: str) -> list[dict]:
    return read_jsonl(os.path.join(fileroot, "logs", "gsm8k-grpo-cpu", "demo", "stats.jsonl"))


def _servers(pid: int) -> list[psutil.Process]:
    out = []
    for c in psutil.Process(pid).children(recursive=True):
        try:
            if "areal.inference.server" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", ["disk", "xccl"]
)  # each runs ~1-1.5 min on 2 cores: only the disk case is in the CI subset
def test_training_server_killed_restarted_run_continues_with_current_weights(tmp_path, mode):
    """kill -9 of one of two servers after step 1: training goes on (full batches) while it
    restarts in the background; once readmitted (xccl: after re-forming the broadcast group
    with it) it serves the current weights: server logprobs = trainer logprobs, and the
    fingerprint check of every sync passes on both servers. Stopped by SIGTERM (xccl) or
    by kill -9 (disk): then every process it started, the restarted server included (it
    was started from the watchdog's spawner thread), dies with it."""
    root = str(tmp_path / "run")
    log = str(tmp_path / "run.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _cmd(root, mode), stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600

        def _until(cond, what):
            while not cond(_stats(root)):
                assert proc.poll() is None, open(log).read()[-4000:]
                assert time.monotonic() < deadline, f"{what} never happened"
                time.sleep(0.2)

        _until(lambda st: any(r.get("global_step") == 1 for r in st), "step 1")
        servers = _servers(proc.pid)
        assert len(servers) == 2, [s.cmdline() for s in servers]
        servers[0].kill()
        _until(lambda st: st and st[-1]["rollout/server_restarts_total"] >= 1, "the readmission")
        n_at_restart = len(_stats(root))
        _until(lambda st: len(st) >= n_at_restart + 3, "3 steps after the readmission")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(_servers(proc.pid)) == 2
        proc.send_signal(signal.SIGTERM if mode == "xccl" else signal.SIGKILL)
        rc = proc.wait(timeout=300)
        if mode == "disk":  # no orphan: PR_SET_PDEATHSIG of every child fired
            _, alive = psutil.wait_procs(children, timeout=30)
            assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    out = open(log).read()
    assert rc == (128 + signal.SIGTERM if mode == "xccl" else -signal.SIGKILL), out[-4000:]
    stats = _stats(root)
    assert [r["global_step"] for r in stats] == list(range(len(stats)))
    assert all(r["batch/n_seqs"] == 16 for r in stats), [r["batch/n_seqs"] for r in stats]
    assert sum(r["rollout/server_restarts"] for r in stats) == 1
    assert stats[-1]["rollout/server_restarts_total"] == 1
    assert stats[-1]["rollout/servers_healthy"] == 2
    assert "readmitted with weights version" in out, out[-4000:]
    if mode == "xccl":
        assert "re-forming the weight-update group" in out, out[-4000:]
    restart_step = next(i for i, r in enumerate(stats) if r["rollout/server_restarts"] > 0)
    after = stats[restart_step + 1 :]
    assert len(after) >= 2
    for r in after:  # synchronous: every token is of the current version
        assert r["consistency/fresh_tokens"] > 0, r
        assert r["consistency/logp_absdiff_max"] < 1e-3, r
    # the fingerprint check after the readmission covered both servers and passed
    assert "verified on 2 server(s)" in out[out.index("readmitted with weights version") :]


def test_launch_server_workers_server_dying_at_start_up_is_started_again(tmp_path):
    """A server killed while the run starts (the soak's server kill during a controller
    relaunch) makes the role start again instead of ending the run."""
    from areal.infra.scheduler.servers import launch_server_workers

    script = tmp_path / "flaky_server.py"
    marker = tmp_path / "died_once"
    script.write_text(
        "import os, sys, http.server\n"
        f"marker = {str(marker)!r}\n"
        "if not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        "    sys.exit(3)  # dies during start-up, once\n"
        "http.server.test(http.server.SimpleHTTPRequestHandler, port=int(sys.argv[1]),"
        " bind='127.0.0.1')\n"
    )
    with LocalScheduler(fileroot=str(tmp_path), startup_timeout=60) as sched:
        addrs = launch_server_workers(
            sched, 1, f"python {script} {{port}}", health_path="/", timeout=60
        )
        assert marker.exists()
        assert requests.get(f"http://{addrs[0]}/", timeout=5).status_code == 200
        assert sched.dead_workers("rollout") == []
