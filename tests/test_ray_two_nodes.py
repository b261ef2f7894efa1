"""The GRPO demo on a three-node Ray cluster made of network namespaces (head + 2 workers).

``ray_netns_cluster`` (``tests/ray_netns_fixture.py``) starts the Ray head on node A and
worker nodes on B and C, each ``ray start --node-ip-address`` with its own temp dir and
a shared auth token. The controller runs on node A (a driver connecting to the head);
the training worker is pinned to A and one inference server to each of B and C
(``scheduling_spec.0.nodelist`` with node IPs), so every request and every xccl weight
update crosses the bridge. 20 steps; held-out accuracy must rise as in the one-node demo.

Then node faults under Ray (after the demo: it kills node C for the rest of the module):
every process of node C (its raylet, the actor and its server) gets SIGKILL after step
1. The rollout goes on on node B; the watchdog finds C's server silent past
``rollout.health_check_timeout`` (or its actor dead), gives it up (``kill_worker``) and
``RayScheduler.restart_worker`` starts it again as an actor pinned to node B
(``node:<ip>``): every prompt is trained exactly ``n_samples`` times, every step runs.
"""

from __future__ import annotations

import re

import pytest
from node_fault_checks import (
    MAX_STEPS,
    assert_no_sample_lost_or_duplicated,
    fault_args,
    run_with_fault,
    stat_at_least,
)
from two_node_demo import (
    assert_learned,
    assert_servers_bound,
    assert_weights_verified,
    demo_command,
    held_out_accuracy,
    run_demo,
)

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

# node-fault run: 0.15-1 s a step (CPU kind, load); the run lasts until the restart is in
# the step stats, then THEN_STEPS steps, then the test stops it (SIGTERM)
THEN_STEPS = 3
FAULT_BATCH = 4
N_SAMPLES = 2
HEALTH_TIMEOUT = 5


def test_gsm8k_grpo_demo_ray_trainer_node_a_servers_nodes_b_c_learns(ray_netns_cluster, tmp_path):
    rc = ray_netns_cluster
    ips = rc.node_ips
    cmd = demo_command(
        tmp_path, "ray", "ray-3n", trainer_nodes=ips["a"],
        server_nodes=f"{ips['b']},{ips['c']}", n_servers=2,
    )  # fmt: skip
    out = run_demo(cmd, rc.env, tmp_path / "demo.out", netns=rc.net["a"].netns)
    # placement: each actor on the node its spec named, and published that node's address
    placed = dict(re.findall(r"Actor (\w+/\d+) pid \d+ on node ([\d.]+)", out))
    assert placed == {"actor/0": ips["a"], "rollout/0": ips["b"], "rollout/1": ips["c"]}, (
        placed, out[-6000:],
    )  # fmt: skip
    logs = tmp_path / "logs" / "gsm8k-grpo-cpu" / "ray-3n"
    assert_servers_bound(logs, [ips["b"], ips["c"]])
    assert f"serving on {ips['a']}:" in (logs / "actor-0.log").read_text()
    # both servers on B and C took every weight version the trainer on A produced
    assert_weights_verified(out, n_servers=2)
    before, after = held_out_accuracy(out)
    print(f"ray three-node demo: held-out {before:.3f} -> {after:.3f}")
    assert_learned(out)
    assert "Stopped actors" in out


def _fault_command(tmp_path, ips: dict[str, str], trial: str) -> list[str]:
    cmd = demo_command(
        tmp_path, "ray", trial, trainer_nodes=ips["a"], server_nodes=f"{ips['b']},{ips['c']}",
        n_servers=2, steps=MAX_STEPS,
    )  # fmt: skip
    drop = ("allocation_mode=", "total_train_steps=", "train_dataset.", "valid_dataset.")
    drop += ("actor.weight_update_mode=",)  # disk: a restarted server loads the current weights
    return [a for a in cmd if not a.startswith(drop)] + [
        *fault_args(MAX_STEPS, FAULT_BATCH, N_SAMPLES, HEALTH_TIMEOUT),
        "valid_dataset.path=synthetic://arith?digits=1&steps=2&n=8&seed=1",
        "valid_dataset.batch_size=8",
        "gconfig.max_new_tokens=16",
        "actor.ppo_n_minibatches=1",
    ]


def test_ray_inference_node_killed_rollout_continues_server_restarted_on_other_node(
    ray_netns_cluster, tmp_path
):
    rc = ray_netns_cluster
    ips = rc.node_ips
    trial = "ray-node-killed"
    killed = []
    out = run_with_fault(
        tmp_path, _fault_command(tmp_path, ips, trial), rc.env, trial,
        lambda: killed.extend(rc.net.kill_node("c")), netns=rc.net["a"].netns,
        stop_when=stat_at_least("rollout/server_restarts_total"), then_steps=THEN_STEPS,
    )  # fmt: skip
    assert killed
    stats = assert_no_sample_lost_or_duplicated(tmp_path, trial, None, FAULT_BATCH, N_SAMPLES)
    assert stats[-1]["rollout/server_restarts_total"] == 1, stats[-1]
    assert stats[-1]["rollout/servers_healthy"] == 2
    # C's server (rollout/1) restarted on node B, the node that is left
    m = re.search(r"inference server rollout/1 \(([^)]*)\) restarted at ([\d.]+):", out)
    assert m, out[-6000:]
    assert m.group(2) == ips["b"], m.group(0)
    assert f"Worker rollout/1 restarted on Ray node {ips['b']} " in out, out[-6000:]
    assert f"Ray node {ips['c']}" in out, out[-6000:]  # the log names the lost node
