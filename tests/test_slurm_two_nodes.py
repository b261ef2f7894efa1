"""The GRPO demo on a two-node Slurm cluster made of network namespaces.

``slurm_two_nodes`` (``tests/slurm_fixture.py``: ``netns_slurm``) starts ``slurmctld`` in
the root namespace (the "login node", ``SlurmctldAddr`` = the bridge address) and one
``slurmd -N n<x>`` inside namespaces A and B of ``tests/netns_cluster.py`` (``NodeAddr`` =
the namespace's address); spool, pid and log files are per node (``%n``). The demo runs
with the training worker pinned to node A and the inference server to node B
(``scheduling_spec.0.nodelist``), so every request and every weight update crosses the
bridge.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from slurm_fixture import demo_command, netns_slurm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory):
    with netns_slurm(str(tmp_path_factory.mktemp("slurm2n")), nodes=("a", "b")) as c:
        yield c


def test_gsm8k_grpo_demo_trainer_node_a_server_node_b(slurm_two_nodes, tmp_path):
    cluster, env, root = slurm_two_nodes
    steps = int(os.environ.get("AREAL_TWO_NODE_STEPS", "3"))
    cmd = demo_command(tmp_path, "slurm")
    cmd = [a for a in cmd if not a.startswith(("total_train_steps=", "train_dataset.path="))]
    cmd += [
        f"total_train_steps={steps}",
        f"train_dataset.path=synthetic://arith?digits=1&steps=2&n={4 * steps * 4}&seed=0",
        "trial_name=two-nodes",
        "actor.scheduling_spec.0.nodelist=na",
        "rollout.scheduling_spec.0.nodelist=nb",
        "actor.weight_update_mode=xccl",  # the weight broadcast crosses the nodes (gloo)
    ]
    env = dict(env, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"two-node demo timed out:\n{out[-6000:]}")
    with open(tmp_path / "demo.out", "w") as f:
        f.write(out)
    assert proc.returncode == 0, out[-6000:]
    # placement: Slurm put each job on the node its spec named ...
    with open(os.path.join(root, "log", "slurmctld.log")) as f:
        allocs = dict(re.findall(r"sched: Allocate JobId=(\d+) NodeList=(\S+)", f.read()))
    tasks = {
        role: (job, ip)
        for role, job, ip in re.findall(r"Task (\w+)/0 of job (\d+) on \S+ \(([\d.]+)\)", out)
    }
    assert set(tasks) == {"actor", "rollout"}, out[-6000:]
    assert allocs[tasks["actor"][0]] == "na" and allocs[tasks["rollout"][0]] == "nb", allocs
    # ... and each process published and bound its own node's address
    assert tasks["actor"][1] == cluster["a"].addr and tasks["rollout"][1] == cluster["b"].addr
    logs = tmp_path / "logs" / "gsm8k-grpo-cpu" / "two-nodes"
    server_log = (logs / "rollout-0.log").read_text()
    assert f"on http://{cluster['b'].addr}:" in server_log, server_log[-3000:]
    assert "0.0.0.0" not in server_log
    assert f"--host {cluster['a'].addr} " in (logs / "actor-0.log").read_text()
    # the server on node B took every weight version the trainer on node A produced
    for v in range(1, steps + 1):
        assert f"weights of version {v} verified on 1 server(s)" in out, out[-6000:]
    assert "Cancelled Slurm jobs" in out
