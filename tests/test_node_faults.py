"""Node faults on a Slurm cluster made of network namespaces (as root; CI runs them).

Scheduler: ``SlurmScheduler`` across the namespaces of ``tests/netns_cluster.py`` (the
real user path of a multi-node run: ``slurmctld`` in the root namespace, one ``slurmd``
per namespace, ``tests/slurm_fixture.py``: ``netns_slurm``). Node A holds the training
worker, nodes B and C one inference server each (``rollout.scheduling_spec.0.nodelist=
nb,nc``: one job, one task per node, ``--no-kill``). The GRPO demo runs on tiny data.

- **inference node killed**: every process of node C (its server and its ``slurmd``)
  gets SIGKILL after step 1. The rollout goes on on node B; the watchdog finds C's server
  silent past ``rollout.health_check_timeout`` (or C's node lost in ``sinfo``), gives it
  up and restarts it as a job of its own on a node with room (B): the run's records show
  every prompt trained exactly ``n_samples`` times, every step, one restart and two
  healthy servers at the end.
- **link cut 30 s**: node C's link goes down for 30 s after step 1, then up. The run
  finishes; the log names the server, its node and the health deadline that expired.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import time

import pytest
from slurm_fixture import demo_command, netns_slurm, start_slurmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 60  # a step takes ~0.5-2 s: the restart (~15-20 s) completes within the run
BATCH = 4
N_SAMPLES = 2
HEALTH_TIMEOUT = 5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_three_nodes(tmp_path_factory):
    # SlurmdTimeout=10: a node that stops answering is DOWN 10 s later
    with netns_slurm(
        str(tmp_path_factory.mktemp("slurm3n")), nodes=("a", "b", "c"), slurmd_timeout=10
    ) as c:
        yield c


def _revive_node(cluster, env, root, node: str, timeout: float = 60) -> None:
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
        if out == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"node n{node} not idle again within {timeout} s")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _command(tmp_path, trial: str) -> list[str]:
    cmd = demo_command(tmp_path, "slurm")
    drop = ("total_train_steps=", "train_dataset.path=", "allocation_mode=", "trial_name=")
    drop += ("gconfig.n_samples=", "train_dataset.batch_size=")
    cmd = [a for a in cmd if not a.startswith(drop)]
    return cmd + [
        f"trial_name={trial}",
        "allocation_mode=local:d2+fsdp:d1",
        f"total_train_steps={STEPS}",
        f"train_dataset.batch_size={BATCH}",
        f"gconfig.n_samples={N_SAMPLES}",
        # one epoch exactly: every row is trained on once
        f"train_dataset.path=synthetic://arith?digits=2&steps=2&n={STEPS * BATCH}&seed=3",
        "actor.dynamic_sampling=false",
        "actor.scheduling_spec.0.nodelist=na",
        "rollout.scheduling_spec.0.nodelist=nb,nc",
        f"rollout.health_check_timeout={HEALTH_TIMEOUT}",
        "rollout.request_timeout=20",
        "rollout.setup_timeout=120",
    ]


def _records(tmp_path, trial: str, name: str) -> list[dict]:
    path = tmp_path / "logs" / "gsm8k-grpo-cpu" / trial / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_with_fault(tmp_path, env, trial: str, fault, timeout: float = 420) -> str:
    """Run the demo; once step 1 is in ``stats.jsonl`` call ``fault()``; return the output."""
    log = tmp_path / f"{trial}.out"
    env = dict(env, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _command(tmp_path, trial), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not any(
            r.get("global_step", -1) >= 1 for r in _records(tmp_path, trial, "stats.jsonl")
        ):
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "step 1 never came\n" + log.read_text()[-6000:]
            time.sleep(0.3)
        fault()
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"run did not end within {timeout} s:\n{log.read_text()[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    return out


def _assert_no_sample_lost_or_duplicated(tmp_path, trial: str) -> list[dict]:
    stats = [r for r in _records(tmp_path, trial, "stats.jsonl") if "batch/reward" in r]
    assert [r["global_step"] for r in stats] == list(range(STEPS)), stats
    consumed = _records(tmp_path, trial, "consumed.jsonl")
    assert [r["global_step"] for r in consumed] == list(range(STEPS))
    assert all(len(r["prompts"]) == BATCH * N_SAMPLES for r in consumed)
    counts = collections.Counter(h for r in consumed for h in r["prompts"])
    # one epoch of STEPS * BATCH distinct prompts, each trained on with its n_samples
    assert len(counts) == STEPS * BATCH, counts
    assert set(counts.values()) == {N_SAMPLES}, counts
    return stats


def test_inference_node_killed_rollout_continues_server_restarted_elsewhere(
    slurm_three_nodes, tmp_path
):
    cluster, env, root = slurm_three_nodes
    _revive_node(cluster, env, root, "c")
    killed = []
    out = _run_with_fault(
        tmp_path, env, "node-killed", lambda: killed.extend(cluster.kill_node("c"))
    )
    assert killed
    stats = _assert_no_sample_lost_or_duplicated(tmp_path, "node-killed")
    assert stats[-1]["rollout/server_restarts_total"] == 1, stats[-1]
    assert stats[-1]["rollout/servers_healthy"] == 2
    # restarted where there is room (node B), not readmitted on C (C stays down)
    m = re.search(r"inference server rollout/(\d) \(([^)]*)\) restarted at ([\d.]+):", out)
    assert m, out[-6000:]
    assert m.group(3) == cluster["b"].addr, m.group(0)
    assert "without a restart" not in out
    assert "on Slurm node nc" in out, out[-6000:]  # the log names the lost node
    assert "restarted by job" in out and f"on nb ({cluster['b'].addr}:" in out, out[-6000:]


def test_inference_node_link_cut_30s_run_finishes_log_names_node(slurm_three_nodes, tmp_path):
    cluster, env, root = slurm_three_nodes
    _revive_node(cluster, env, root, "c")

    def cut():
        cluster.set_link("c", False)
        try:
            time.sleep(30)
        finally:
            cluster.set_link("c", True)

    out = _run_with_fault(tmp_path, env, "link-cut", cut)
    _assert_no_sample_lost_or_duplicated(tmp_path, "link-cut")
    # the log names the server on node C and what timed out
    assert re.search(rf"inference server rollout/\d \({re.escape(cluster['c'].addr)}:\d+\)", out), (
        out[-6000:]
    )
    assert "on Slurm node nc" in out, out[-6000:]
