"""RayScheduler on a local Ray (started by the scheduler, 2 logical CPUs).

The module shares one scheduler (Ray start-up ~7 s); the last scheduler test closes it and
checks that no Ray process of ours is left. The end-to-end test runs the GRPO demo with
``scheduler.type=ray`` in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import ray
import torch

from areal.api.scheduler_api import (  # noqa: E402
    Job,
    RemoteCallError,
    SchedulingSpec,
    WorkerDiedError,
)
from areal.infra.scheduler.ray import RayScheduler  # noqa: E402

ECHO = "tests._rpc_engines.EchoEngine"
DIST = "tests._rpc_engines.DistTestEngine"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow  # a local Ray takes ~7 s to start


def _ray_descendants() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            text = " ".join(p.cmdline()) + " " + p.name()
        except psutil.Error:
            continue
        if "ray" in text:
            out.append(p)
    return out


@pytest.fixture(scope="module")
def ray_sched(tmp_path_factory):
    if ray.is_initialized():
        pytest.skip("a Ray session is already initialised in this process")
    os.environ.pop("RAY_ADDRESS", None)
    sched = RayScheduler(
        fileroot=str(tmp_path_factory.mktemp("ray_fileroot")),
        experiment_name="exp",
        trial_name="t0",
        num_cpus=2,
        startup_timeout=120,
    )
    try:
        sched.create_workers(Job(replicas=2, role="actor", tasks=[SchedulingSpec(cpu=0, mem=1)]))
        yield sched
    finally:
        sched.close()


def test_create_workers_two_rpc_actors_healthy_with_dist_env(ray_sched):
    import requests

    workers = ray_sched.get_workers("actor")
    assert [w.id for w in workers] == ["actor/0", "actor/1"]
    pids = []
    for i, w in enumerate(workers):
        health = requests.get(f"http://{w.address}/health", timeout=5).json()
        assert health["status"] == "ok"
        pids.append(health["pid"])
        ray_sched.create_engine(w.id, ECHO, scale=2.0, engine_name="echo")
        env = {
            k: ray_sched.call_engine(w.id, "env", k, engine_name="echo")
            for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "AREAL_WORKER_ID")
        }
        assert env["RANK"] == str(i) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == workers[0].ip
        assert env["MASTER_PORT"] == workers[0].worker_ports[1]
        assert env["AREAL_WORKER_ID"] == w.id
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert ray_sched.name_resolve.get("exp/t0/workers/actor/1") == workers[1].address


def test_call_engine_tensor_roundtrip_returns_result(ray_sched):
    out = ray_sched.call_engine(
        "actor/1", "add", torch.ones(3), torch.arange(3.0), engine_name="echo"
    )
    assert torch.equal(out, (torch.ones(3) + torch.arange(3.0)) * 2.0)


def test_call_engine_method_raises_remote_error_with_traceback(ray_sched):
    with pytest.raises(RemoteCallError, match="engine failure: nope") as ei:
        ray_sched.call_engine("actor/0", "fail", "nope", engine_name="echo")
    assert "actor/0" in str(ei.value) and "Traceback" in ei.value.remote_traceback


def test_dist_engine_two_actors_gloo_all_reduce_sees_world_two(ray_sched):
    from concurrent.futures import ThreadPoolExecutor

    ids = [w.id for w in ray_sched.get_workers("actor")]
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda i: ray_sched.create_engine(i, DIST, engine_name="dist"), ids))
        list(
            ex.map(
                lambda i: ray_sched.call_engine(i, "initialize", engine_name="dist", timeout=60),
                ids,
            )
        )
        worlds = list(
            ex.map(lambda i: ray_sched.call_engine(i, "world", engine_name="dist", timeout=60), ids)
        )
    assert worlds == [2, 2]


def test_create_workers_command_worker_serves_and_logs(ray_sched):
    job = Job(
        replicas=1,
        role="cmd",
        tasks=[
            SchedulingSpec(
                cpu=0, mem=1, port_count=1, cmd="python -m http.server {port} --bind {host}"
            )
        ],
        health_path="/",
    )
    ray_sched.create_workers(job)
    (w,) = ray_sched.get_workers("cmd")
    import requests

    assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
    log = ray_sched.log_path("cmd/0")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if "GET /" in open(log).read():
            break
        time.sleep(0.2)
    assert "GET /" in open(log).read()
    ray_sched.delete_workers("cmd")
    with pytest.raises(KeyError):
        ray_sched.get_workers("cmd")
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{w.address}/", timeout=5)


def test_call_engine_killed_actor_raises_worker_died_naming_it(ray_sched):
    ray_sched.create_workers(Job(replicas=1, role="victim", tasks=[SchedulingSpec(cpu=0, mem=1)]))
    ray_sched.create_engine("victim/0", ECHO)
    assert ray_sched.call_engine("victim/0", "sleep", 0.0) == 0.0
    handle = ray_sched.actor_handle("victim/0")
    ray.kill(handle, no_restart=True)
    # ray.kill is asynchronous: wait until Ray itself reports the actor dead, so the call
    # below cannot race the kill (it used to succeed now and then)
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, "Ray did not report the killed actor dead in 60 s"
        time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="victim/0") as ei:
        ray_sched.call_engine("victim/0", "sleep", 0.0, timeout=30)
    assert time.monotonic() - t0 < 20
    assert "Ray actor died" in str(ei.value)
    with pytest.raises(WorkerDiedError, match="victim/0"):
        ray_sched.get_workers("victim")
    ray_sched.delete_workers("victim")


def test_ray_name_resolve_add_get_subtree_delete_behave_like_file_backend(ray_sched):
    from areal.utils.name_resolve import (
        NameEntryExistsError,
        NameEntryNotFoundError,
        RayNameRecordRepository,
    )

    repo = RayNameRecordRepository(ray_sched.name_resolve_actor)  # same named actor
    repo.add("nr/a/0", "x")
    repo.add("nr/a/1", "y")
    with pytest.raises(NameEntryExistsError):
        repo.add("nr/a/0", "z")
    repo.add("nr/a/0", "z", replace=True)
    assert ray_sched.name_resolve.get("nr/a/0") == "z"
    assert repo.find_subtree("nr/a") == ["nr/a/0", "nr/a/1"]
    assert repo.get_subtree("nr") == ["z", "y"]
    repo.delete("nr/a/1")
    with pytest.raises(NameEntryNotFoundError):
        repo.get("nr/a/1")
    with pytest.raises(TimeoutError):
        repo.wait("nr/a/1", timeout=0.3)
    repo.clear_subtree("nr")
    assert repo.find_subtree("nr") == []


def test_nodelist_unknown_node_or_exclude_refused_naming_field_and_nodes(ray_sched):
    ip = ray.util.get_node_ip_address()
    pins = ray_sched._node_pins(SchedulingSpec(cpu=0, mem=1, nodelist=f"{ip},{ip}"), 3)
    assert pins == [{f"node:{ip}": 0.001}] * 3
    bad = Job(replicas=1, role="nowhere", tasks=[SchedulingSpec(cpu=0, mem=1, nodelist="10.9.9.9")])
    with pytest.raises(ValueError, match=r"nodelist='10\.9\.9\.9'.*no alive Ray node") as ei:
        ray_sched.create_workers(bad)
    assert ip in str(ei.value)  # the nodes that exist are listed
    ex = Job(replicas=1, role="excl", tasks=[SchedulingSpec(cpu=0, mem=1, exclude="n1")])
    with pytest.raises(ValueError, match="SchedulingSpec.exclude='n1' is not supported"):
        ray_sched.create_workers(ex)
    assert "nowhere" not in ray_sched._roles and "excl" not in ray_sched._roles


def test_server_given_up_or_dead_restart_worker_serves_again_old_actor_gone(ray_sched):
    """kill_worker / dead_workers / restart_worker (the watchdog's API) on one node: the
    lost node is the only one, so the restart lands there again, as a new actor."""
    import requests

    spec = SchedulingSpec(cpu=0, mem=1, port_count=1, cmd=f"{sys.executable} -m http.server {{port}} --bind {{host}}")  # fmt: skip
    ray_sched.create_workers(Job(replicas=2, role="srv", tasks=[spec], health_path="/"))
    old = [w.address for w in ray_sched.get_workers("srv")]
    assert ray_sched.dead_workers("srv") == []
    with pytest.raises(ValueError, match="is alive"):
        ray_sched.restart_worker("srv/1")
    with pytest.raises(ValueError, match="RPC worker"):
        ray_sched.kill_worker("actor/0")
    # a silent server given up: its actor is killed, the worker reported dead at once
    ray_sched.kill_worker("srv/1")
    assert ray_sched.dead_workers("srv") == ["srv/1"]
    w1 = ray_sched.restart_worker("srv/1", timeout=60)
    assert requests.get(f"http://{w1.address}/", timeout=5).status_code == 200
    assert ray_sched.dead_workers("srv") == []
    assert ray_sched.name_resolve.get(ray_sched._key("srv", 1)) == w1.address
    # an actor that dies on its own (as on a lost node): reported dead, restarted
    ray.kill(ray_sched.actor_handle("srv/0"), no_restart=True)
    deadline = time.monotonic() + 60
    while ray_sched.dead_workers("srv") != ["srv/0"]:
        assert time.monotonic() < deadline, "the killed actor was never reported dead"
        time.sleep(0.1)
    assert f"Ray node {ray.util.get_node_ip_address()} (alive" in ray_sched.worker_exit_info(
        "srv/0"
    )
    w0 = ray_sched.restart_worker("srv/0", timeout=60)
    assert [w.address for w in ray_sched.get_workers("srv")] == [w0.address, w1.address]
    assert requests.get(f"http://{w0.address}/", timeout=5).status_code == 200

    def gone(addr: str) -> bool:  # ray.kill is asynchronous: poll
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(f"http://{addr}/", timeout=2)
            except requests.ConnectionError:
                return True
            time.sleep(0.2)
        return False

    # the old servers died with their actors (unless a new one took the same port)
    assert all(gone(a) for a in old if a not in (w0.address, w1.address))
    ray_sched.delete_workers("srv")
    assert gone(w0.address) and gone(w1.address)


def test_close_kills_actors_and_local_ray_no_processes_left(ray_sched):
    ours = _ray_descendants()
    assert ours, "expected the local Ray's processes to be children of the test process"
    ray_sched.close()
    assert not ray.is_initialized()
    assert not os.path.exists(os.path.join(ray_sched.fileroot, "name_resolve"))
    _, alive = psutil.wait_procs(ours, timeout=30)
    assert not [p.pid for p in alive], [p.cmdline() for p in alive]
    assert not [p for p in _ray_descendants() if "ray::" in " ".join(p.cmdline())]


# ---------------------------------------------------------------------------- end to end
def test_gsm8k_grpo_demo_ray_scheduler_two_steps_then_no_ray_left(tmp_path):
    from slurm_fixture import demo_command

    cmd = demo_command(tmp_path, "ray")
    marker = f"ray-e2e-{os.getpid()}-{time.time_ns()}"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", AREAL_TEST_MARKER=marker)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"demo with scheduler.type=ray timed out:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert "Shutting down the local Ray" in out
    assert _procs_with_marker(marker) == []


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    proc.kill()
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass


def _procs_with_marker(marker: str) -> list[str]:
    """Command lines of live processes that inherited ``AREAL_TEST_MARKER=marker``."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("AREAL_TEST_MARKER") == marker:
                left.append(" ".join(p.info["cmdline"] or []))
        except psutil.Error:
            continue
    return left


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
