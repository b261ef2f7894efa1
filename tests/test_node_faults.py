"""Node faults on a Slurm cluster made of network namespaces (as root; CI runs them).

Scheduler: ``SlurmScheduler`` across the namespaces of ``tests/netns_cluster.py`` (the
real user path of a multi-node run: ``slurmctld`` in the root namespace, one ``slurmd``
per namespace, ``tests/slurm_fixture.py``: ``netns_slurm``). Node A holds the training
worker, nodes B and C one inference server each (``rollout.scheduling_spec.0.nodelist=
nb,nc``: one single-task job per server, pinned to its node). The GRPO demo runs on tiny
data.

- **inference node killed**: every process of node B (its server, its job's batch script
  and its ``slurmd``) gets SIGKILL after step 1. The rollout goes on on node C (a job of
  its own: with one job for both servers, the death of B, its batch host, ended C's
  server too); the watchdog finds B's server silent past
  ``rollout.health_check_timeout`` (or B's node lost in ``sinfo``), gives it up and
  restarts it as a job of its own on a node with room (C): the run's records show
  every prompt trained exactly ``n_samples`` times, every step, one restart and two
  healthy servers at the end.
- **trainer node killed**: node A dies in step 3 of a synchronous
  run; the run stops naming the node; the relaunch resumes with the per-step losses of
  an uninterrupted run.

The 30 s link cut is in ``tests/test_node_link_cut.py`` (a cluster of its own, with a
``SlurmdTimeout`` longer than the cut).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests
from _jsonl import read_jsonl
from node_fault_checks import (
    MAX_STEPS,
    REPO,
    assert_no_sample_lost_or_duplicated,
    run_with_fault,
    slurm_fault_command,
    stat_at_least,
)
from slurm_fixture import netns_slurm, slurm_cluster, start_slurmd  # noqa: F401

from areal.api.scheduler_api import Job, SchedulingSpec
from areal.infra.scheduler.slurm import SlurmScheduler

# 0.15-2 s a step (CPU kind, load): the run is as long as the restart takes; the test ends
# it (SIGTERM) THEN_STEPS steps after the restart is in the step stats
THEN_STEPS = 3
BATCH = 4
N_SAMPLES = 2
HEALTH_TIMEOUT = 5

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def test_slurm_server_task_killed_job_lives_kill_worker_restart_worker_serves(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    """One node (nowhere else to go): each server is a job of its own, so one server's
    death ends its job only; the restart lands on the same node, as a new job."""
    sched = SlurmScheduler(
        fileroot=str(tmp_path), experiment_name="exp", trial_name="nf",
        slurm_conf=slurm_cluster.conf, startup_timeout=120, state_poll_interval=0.5,
    )  # fmt: skip
    try:
        spec = SchedulingSpec(
            cmd=f"{sys.executable} -m http.server {{port}} --bind {{host}}", cpu=1, mem=1
        )
        job = Job(replicas=2, role="srv", tasks=[spec], health_path="/", distributed_env=False)
        sched.create_workers(job)
        old = [w.address for w in sched.get_workers("srv")]
        first_jobs = sched.job_ids("srv")
        assert len(set(first_jobs)) == 2
        os.kill(sched.worker_pids("srv")[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while sched.dead_workers("srv") != ["srv/1"]:  # its job ended; srv/0's lives on
            assert time.monotonic() < deadline, sched.dead_workers("srv")
            time.sleep(0.5)
        assert requests.get(f"http://{old[0]}/", timeout=5).status_code == 200
        sched.kill_worker("srv/1")
        assert sched.dead_workers("srv") == ["srv/1"]
        w = sched.restart_worker("srv/1", timeout=120)
        assert requests.get(f"http://{w.address}/", timeout=5).status_code == 200
        assert sched.dead_workers("srv") == []
        assert sched.worker_info("srv/1")["job_id"] not in ("", *first_jobs)
        assert [x.address for x in sched.get_workers("srv")] == [old[0], w.address]
    finally:
        sched.close()
    assert slurm_cluster.jobs() == []  # the replacement job was cancelled too


@pytest.fixture(scope="module")
def slurm_three_nodes(tmp_path_factory):
    # SlurmdTimeout=10: a node that stops answering is DOWN 10 s later
    with netns_slurm(
        str(tmp_path_factory.mktemp("slurm3n")), nodes=("a", "b", "c"), slurmd_timeout=10
    ) as c:
        yield c


def _revive_node(cluster, env, root, node: str, timeout: float = 150) -> None:
    """Restart ``slurmd`` of a node a previous test killed; wait until it is idle."""
    if any("slurmd" in _cmdline(p) for p in cluster.pids(node)):
        return
    logs = open(os.path.join(root, "log", "daemons.out"), "ab")  # noqa: SIM115
    proc = start_slurmd(cluster, node, env["SLURM_CONF"], env, logs)
    cluster._procs.append(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-n", f"n{node}", "-o", "%T"], env=env, capture_output=True,
            text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        # responding again (a job of the killed node may still be completing there)
        if out and not out.endswith("*") and not out.startswith(("down", "drain", "fail")):
            return
        time.sleep(0.5)
    raise RuntimeError(f"node n{node} not back in service within {timeout} s (sinfo: {out!r})")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _command(tmp_path, trial: str) -> list[str]:
    return slurm_fault_command(tmp_path, trial, MAX_STEPS, BATCH, N_SAMPLES, HEALTH_TIMEOUT)


def test_inference_node_killed_rollout_continues_server_restarted_elsewhere(
    slurm_three_nodes, tmp_path
):
    cluster, env, root = slurm_three_nodes
    _revive_node(cluster, env, root, "b")
    _revive_node(cluster, env, root, "c")
    killed = []
    out = run_with_fault(
        tmp_path, _command(tmp_path, "node-killed"), env, "node-killed",
        lambda: killed.extend(cluster.kill_node("b")),
        stop_when=stat_at_least("rollout/server_restarts_total"), then_steps=THEN_STEPS,
    )  # fmt: skip
    assert killed
    stats = assert_no_sample_lost_or_duplicated(tmp_path, "node-killed", None, BATCH, N_SAMPLES)
    assert stats[-1]["rollout/server_restarts_total"] == 1, stats[-1]
    assert stats[-1]["rollout/servers_healthy"] == 2
    # restarted where there is room (node C), not readmitted on B (B stays down)
    m = re.search(r"inference server rollout/(\d) \(([^)]*)\) restarted at ([\d.]+):", out)
    assert m, out[-6000:]
    assert m.group(1) == "0" and m.group(3) == cluster["c"].addr, m.group(0)
    assert "without a restart" not in out
    assert "on Slurm node nb" in out, out[-6000:]  # the log names the lost node
    assert "restarted by job" in out and f"on nc ({cluster['c'].addr}:" in out, out[-6000:]


def _sync_command(tmp_path, root: str, trial: str, steps: int, actor: str = "na") -> list[str]:
    cmd = [
        a for a in _command(tmp_path, trial)
        if not a.startswith(("cluster.fileroot=", "allocation_mode=", "total_train_steps=",
                             "rollout.scheduling_spec.", "train_dataset.path=", "recover.",
                             "actor.scheduling_spec."))
    ]  # fmt: skip
    return cmd + [
        f"actor.scheduling_spec.0.nodelist={actor}",
        f"cluster.fileroot={root}",
        "allocation_mode=local:d1+fsdp:d1",
        "rollout.scheduling_spec.0.nodelist=nb",
        f"total_train_steps={steps}",
        f"train_dataset.path=synthetic://arith?digits=2&steps=2&n={steps * BATCH}&seed=3",
        "async_training=false",
        "rollout.max_head_offpolicyness=0",
        "recover.mode=auto",
        "recover.freq_steps=1",
    ]


def test_trainer_node_killed_run_stops_clearly_relaunch_resumes_same_losses(
    slurm_three_nodes, tmp_path
):
    cluster, env, root = slurm_three_nodes
    # killed once step k is logged: the run is then in step k+1, with steps-k-1 more steps
    # (>= 0.5 s at the fastest CPU kind's sync pace) before it could end by itself
    steps, k = 6, 1
    env = dict(env, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    ref_root, crash_root = str(tmp_path / "ref"), str(tmp_path / "crash")

    def stats(r):
        p = os.path.join(r, "logs", "gsm8k-grpo-cpu", "trainer-node", "stats.jsonl")
        return [x for x in read_jsonl(p) if "batch/reward" in x]

    _revive_node(cluster, env, root, "a")
    _revive_node(cluster, env, root, "b")  # the server's node
    _revive_node(cluster, env, root, "c")
    with open(tmp_path / "ref.out", "w") as f:  # the uninterrupted run, beside, on node C
        ref = subprocess.Popen(
            _sync_command(tmp_path, ref_root, "trainer-node", steps, actor="nc"), cwd=REPO,
            env=env,
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        with open(tmp_path / "crash1.out", "w") as f:
            crash = subprocess.Popen(
                _sync_command(tmp_path, crash_root, "trainer-node", steps), cwd=REPO,
                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while not any(r["global_step"] >= k for r in stats(crash_root)):
            assert crash.poll() is None, (tmp_path / "crash1.out").read_text()[-6000:]
            assert time.monotonic() < deadline, (tmp_path / "crash1.out").read_text()[-6000:]
            time.sleep(0.05)
        # the training worker is in its next step; kill the node under it
        assert cluster.kill_node("a")
        rc = crash.wait(timeout=180)
        out1 = (tmp_path / "crash1.out").read_text()
        assert rc != 0, out1[-6000:]
        # the error that stopped it names the worker and its node (not a bare connection error)
        assert "Worker actor/0 (Slurm job" in out1 and "is dead during" in out1, out1[-6000:]
        assert "its node na (" in out1, out1[-6000:]
        assert "RuntimeError: Worker actor/0" not in out1, out1[-6000:]
        assert "no longer answers slurmctld" in out1, out1[-6000:]
        _revive_node(cluster, env, root, "a")
        with open(tmp_path / "crash2.out", "w") as f:
            resumed = subprocess.run(
                _sync_command(tmp_path, crash_root, "trainer-node", steps), cwd=REPO,
                env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300,
            )  # fmt: skip
        ref_rc = ref.wait(timeout=300)
    finally:
        for p in (ref, locals().get("crash")):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    out2 = (tmp_path / "crash2.out").read_text()
    assert ref_rc == 0, (tmp_path / "ref.out").read_text()[-6000:]
    assert resumed.returncode == 0, out2[-6000:]
    m = re.search(r"continuing at step (\d+)", out2)
    assert m, out2[-6000:]
    got, want = stats(crash_root), stats(ref_root)
    assert [r["global_step"] for r in want] == list(range(steps))
    assert sorted({r["global_step"] for r in got}) == list(range(steps))
    resumed_from = int(m.group(1))
    by_step = {r["global_step"]: r for r in got}  # the resumed run's rows win
    for a in want[resumed_from:]:
        b = by_step[a["global_step"]]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4), (a["global_step"], a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-4)
