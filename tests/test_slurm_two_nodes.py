"""The GRPO demo on a three-node Slurm cluster made of network namespaces, 20 steps.

``slurm_two_nodes`` (``tests/slurm_fixture.py``: ``netns_slurm``) starts ``slurmctld`` in
the root namespace (the "login node", ``SlurmctldAddr`` = the bridge address) and one
``slurmd -N n<x>`` inside namespaces A, B and C of ``tests/netns_cluster.py``
(``NodeAddr`` = the namespace's address); spool, pid and log files are per node (``%n``).
The demo runs with the training worker pinned to node A and one inference server on each
of B and C (``scheduling_spec.0.nodelist``), so every request and every xccl weight update
crosses the bridge; held-out accuracy must rise as in the one-node demo.
"""

from __future__ import annotations

import os
import re

import pytest
from slurm_fixture import netns_slurm
from two_node_demo import (
    assert_learned,
    assert_servers_bound,
    assert_weights_verified,
    demo_command,
    held_out_accuracy,
    run_demo,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory):
    with netns_slurm(str(tmp_path_factory.mktemp("slurm2n")), nodes=("a", "b", "c")) as c:
        yield c


def test_gsm8k_grpo_demo_slurm_trainer_node_a_servers_nodes_b_c_learns(slurm_two_nodes, tmp_path):
    cluster, env, root = slurm_two_nodes
    cmd = demo_command(
        tmp_path, "slurm", "slurm-3n", trainer_nodes="na", server_nodes="nb,nc", n_servers=2
    )
    out = run_demo(cmd, env, tmp_path / "demo.out")
    # placement: Slurm put each job on the node(s) its spec named ...
    with open(os.path.join(root, "log", "slurmctld.log")) as f:
        allocs = dict(re.findall(r"sched: Allocate JobId=(\d+) NodeList=(\S+)", f.read()))
    tasks = {
        (role, int(rank)): (job, ip)
        for role, rank, job, ip in re.findall(
            r"Task (\w+)/(\d+) of job (\d+) on \S+ \(([\d.]+)\)", out
        )
    }
    assert set(tasks) == {("actor", 0), ("rollout", 0), ("rollout", 1)}, (tasks, out[-6000:])
    assert allocs[tasks[("actor", 0)][0]] == "na", allocs
    # one single-task job per server, each on its node of the spec's nodelist
    assert allocs[tasks[("rollout", 0)][0]] == "nb", allocs
    assert allocs[tasks[("rollout", 1)][0]] == "nc", allocs
    # ... one server task per inference node, each publishing and binding its own address
    assert tasks[("actor", 0)][1] == cluster["a"].addr
    assert {tasks[("rollout", i)][1] for i in (0, 1)} == {cluster["b"].addr, cluster["c"].addr}
    logs = tmp_path / "logs" / "gsm8k-grpo-cpu" / "slurm-3n"
    assert_servers_bound(logs, [tasks[("rollout", i)][1] for i in (0, 1)])
    assert f"--host {cluster['a'].addr} " in (logs / "actor-0.log").read_text()
    # both servers took every weight version the trainer on node A produced
    assert_weights_verified(out, n_servers=2)
    before, after = held_out_accuracy(out)
    print(f"slurm three-node demo: held-out {before:.3f} -> {after:.3f}")
    assert_learned(out)
    assert "Cancelled Slurm jobs" in out
