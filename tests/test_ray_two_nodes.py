"""The GRPO demo on a three-node Ray cluster made of network namespaces (head + 2 workers).

``ray_netns_cluster`` (``tests/ray_netns_fixture.py``) starts the Ray head on node A and
worker nodes on B and C, each ``ray start --node-ip-address`` with its own temp dir and
a shared auth token. The controller runs on node A (a driver connecting to the head);
the training worker is pinned to A and one inference server to each of B and C
(``scheduling_spec.0.nodelist`` with node IPs), so every request and every xccl weight
update crosses the bridge. 20 steps; held-out accuracy must rise as in the one-node demo.
"""

from __future__ import annotations

import re

import pytest
from two_node_demo import (
    assert_learned,
    assert_servers_bound,
    assert_weights_verified,
    demo_command,
    held_out_accuracy,
    run_demo,
)

pytestmark = pytest.mark.slow


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
