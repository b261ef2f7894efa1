"""SlurmScheduler against a real single-node Slurm (``tests/slurm_fixture.py``).

Skips when not root or the Slurm binaries are missing; ``.ci/run`` installs them. The
end-to-end test runs the GRPO demo with ``scheduler.type=slurm`` in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from slurm_fixture import demo_command, slurm_cluster  # noqa: F401 - pytest fixture

from areal.api.scheduler_api import Job, RemoteCallError, SchedulingSpec, WorkerDiedError
from areal.infra.scheduler.slurm import SlurmScheduler

ECHO = "tests._rpc_engines.EchoEngine"
DIST = "tests._rpc_engines.DistTestEngine"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow  # daemons + sbatch + worker start-up: ~15 s


@pytest.fixture(scope="module")
def slurm_sched(slurm_cluster, tmp_path_factory):  # noqa: F811
    sched = SlurmScheduler(
        fileroot=str(tmp_path_factory.mktemp("slurm_fileroot")),
        experiment_name="exp",
        trial_name="t0",
        slurm_conf=slurm_cluster.conf,
        startup_timeout=120,
        state_poll_interval=1.0,
    )
    try:
        sched.create_workers(Job(replicas=2, role="actor", tasks=[SchedulingSpec(cpu=1, mem=1)]))
        yield sched
    finally:
        sched.close()


def test_create_workers_two_tasks_healthy_with_dist_env(slurm_sched, slurm_cluster):  # noqa: F811
    workers = slurm_sched.get_workers("actor")
    assert [w.id for w in workers] == ["actor/0", "actor/1"]
    job_id = slurm_sched.job_id("actor")
    assert job_id in slurm_cluster.jobs()
    for i, w in enumerate(workers):
        slurm_sched.create_engine(w.id, ECHO, scale=3.0, engine_name="echo")
        env = {
            k: slurm_sched.call_engine(w.id, "env", k, engine_name="echo")
            for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID")
        }
        assert env["RANK"] == str(i) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == workers[0].ip
        assert env["SLURM_JOB_ID"] == job_id
    assert slurm_sched.name_resolve.get("exp/t0/workers/actor/1") == workers[1].address


def test_call_engine_tensor_roundtrip_returns_result(slurm_sched):
    out = slurm_sched.call_engine(
        "actor/1", "add", torch.ones(2), torch.ones(2), engine_name="echo"
    )
    assert torch.equal(out, torch.full((2,), 6.0))
    with pytest.raises(RemoteCallError, match="engine failure: x"):
        slurm_sched.call_engine("actor/0", "fail", "x", engine_name="echo")


def test_dist_engine_two_tasks_gloo_all_reduce_sees_world_two(slurm_sched):
    from concurrent.futures import ThreadPoolExecutor

    ids = ["actor/0", "actor/1"]
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda i: slurm_sched.create_engine(i, DIST, engine_name="d"), ids))
        list(ex.map(lambda i: slurm_sched.call_engine(i, "initialize", engine_name="d"), ids))
        worlds = list(ex.map(lambda i: slurm_sched.call_engine(i, "world", engine_name="d"), ids))
    assert worlds == [2, 2]


def test_call_engine_killed_task_raises_worker_died_naming_it(slurm_sched):
    slurm_sched.create_workers(Job(replicas=1, role="victim", tasks=[SchedulingSpec(cpu=1, mem=1)]))
    slurm_sched.create_engine("victim/0", ECHO)
    os.kill(slurm_sched.worker_info("victim/0")["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="victim/0") as ei:
        slurm_sched.call_engine("victim/0", "sleep", 0.0, timeout=60)
    assert time.monotonic() - t0 < 30
    assert slurm_sched.job_id("victim") in str(ei.value)
    slurm_sched.delete_workers("victim")


def test_close_cancels_jobs_squeue_empty(slurm_sched, slurm_cluster):  # noqa: F811
    assert slurm_cluster.jobs()
    slurm_sched.close()
    assert slurm_cluster.jobs() == []
    with pytest.raises(KeyError):
        slurm_sched.get_workers("actor")


# ---------------------------------------------------------------------------- end to end
def test_gsm8k_grpo_demo_slurm_scheduler_two_steps_then_squeue_empty(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    env = dict(slurm_cluster.env, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        demo_command(tmp_path, "slurm"),
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
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        subprocess.run(["scancel", "-u", "root"], env=slurm_cluster.env, timeout=30)
        pytest.fail(f"demo with scheduler.type=slurm timed out:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert "Cancelled Slurm jobs" in out
    assert slurm_cluster.jobs() == []


def test_slurm_launcher_submits_controller_script_wait_returns_its_exit_code(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    script = tmp_path / "controller.py"
    script.write_text(
        "import sys\nopen(sys.argv[-1].split('=')[0] + '.seen', 'w').write(' '.join(sys.argv[1:]))\n"
    )
    cfg = tmp_path / "cfg.yaml"
    hook_out = tmp_path / "hook.out"
    cfg.write_text(
        f"experiment_name: launch\ntrial_name: t1\ncluster:\n  fileroot: {tmp_path}\n"
        f"post_exit_hook: 'echo \"$LOG_DIR $SLURM_JOB_ID\" > {hook_out}'\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "areal.infra.launcher.slurm", "--wait", "--cpus", "1", "--mem", "1",
         str(script), "--config", str(cfg), "a.b=1"],
        cwd=str(tmp_path), env=dict(slurm_cluster.env, PYTHONPATH=REPO),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    log = tmp_path / "logs" / "launch" / "t1" / f"controller-{job_id}.log"
    assert log.exists()
    seen = (tmp_path / "scheduler.type.seen").read_text()
    assert seen.endswith("a.b=1 scheduler.type=slurm")
    # post_exit_hook ran inside the job, after the controller, with LOG_DIR set
    assert hook_out.read_text().split() == [str(log.parent), job_id]
    assert slurm_cluster.jobs() == []


def test_spec_reservation_and_exclusive_reach_slurm_and_a_bad_reservation_fails_clearly(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    """``SchedulingSpec.reservation`` / ``exclusive`` (AReaL 2.0's Slurm fields) as Slurm
    sees them: a held job's ``scontrol show job`` names the reservation and no sharing; a
    reservation Slurm does not know fails the submission with sbatch's reason."""
    slurm_cluster.run(
        "scontrol", "create", "reservation", "reservationname=areal_res", "starttime=now",
        "duration=10", f"nodes={slurm_cluster.node}", "users=root", "flags=ignore_jobs",
    )  # fmt: skip
    sched = SlurmScheduler(
        fileroot=str(tmp_path),
        experiment_name="exp",
        trial_name="res",
        slurm_conf=slurm_cluster.conf,
        sbatch_args=["--hold"],  # Slurm records the job's settings; it never starts
    )
    try:
        os.makedirs(sched.log_dir, exist_ok=True)  # create_workers makes it
        spec = SchedulingSpec(cpu=1, mem=1, reservation="areal_res", exclusive=True)
        sjob = sched._submit(Job(replicas=1, role="pinned", tasks=[spec]), rank=None)
        shown = slurm_cluster.run("scontrol", "show", "job", sjob.job_id)
        assert "Reservation=areal_res" in shown, shown
        assert "OverSubscribe=NO" in shown, shown  # --exclusive
        slurm_cluster.run("scancel", sjob.job_id)
        bad = SchedulingSpec(cpu=1, mem=1, reservation="no_such_reservation")
        with pytest.raises(RuntimeError, match=r"sbatch.*(?i:reservation)"):
            sched._submit(Job(replicas=1, role="bad", tasks=[bad]), rank=None)
    finally:
        sched.close()
        slurm_cluster.run("scontrol", "delete", "reservationname=areal_res")
