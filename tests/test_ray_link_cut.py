"""A 30 s link cut of an inference node on the three-node Ray cluster (``cluster_faults``).

Same set-up as the node kill of ``tests/test_ray_two_nodes.py`` (a Ray cluster of its
own: ``ray_netns_cluster`` is module-scoped; the controller and the training worker on
node A, one inference server on each of B and C): node C's link goes down for 30 s after
step 1, then up. Expected (docs/fault_tolerance.md, "Node faults", the Ray table): the run
is survived: B's server never leaves the rotation, C's server is silent past
``rollout.health_check_timeout`` and the log says so, naming its address, then gives it
up naming Ray node C; it is restarted on node B; no sample is lost or trained twice; the
run goes on for ``THEN_STEPS`` steps after the link is back (whatever Ray then does with
node C and the killed actor must not disturb it) and the test stops it (SIGTERM).

``make check`` (so ``.ci/run``) runs it with the ``serial`` files; ``make cluster-faults``
runs it alone: ~2-3 minutes on 2 cores (a Ray cluster of its own and the 30 s cut).
"""

from __future__ import annotations

import re
import time

import pytest
from node_fault_checks import (
    MAX_STEPS,
    assert_no_sample_lost_or_duplicated,
    fault_args,
    run_with_fault,
    stat_at_least,
)
from two_node_demo import demo_command

# serial: a fault timeout (`rollout.health_check_timeout`) that a busy neighbour would change
pytestmark = [pytest.mark.slow, pytest.mark.cluster_faults, pytest.mark.serial]

THEN_STEPS = 5  # steps the run must complete after the link is back
BATCH = 4
N_SAMPLES = 2
HEALTH_TIMEOUT = 5


def test_ray_inference_node_link_cut_30s_survived_server_replaced_log_names_node(
    ray_netns_cluster, tmp_path
):
    rc = ray_netns_cluster
    ips = rc.node_ips
    trial = "ray-link-cut"
    cmd = demo_command(
        tmp_path, "ray", trial, trainer_nodes=ips["a"], server_nodes=f"{ips['b']},{ips['c']}",
        n_servers=2, steps=MAX_STEPS,
    )  # fmt: skip
    drop = ("allocation_mode=", "total_train_steps=", "train_dataset.", "valid_dataset.")
    drop += ("actor.weight_update_mode=",)  # disk: a restarted server loads the current weights
    cmd = [a for a in cmd if not a.startswith(drop)] + [
        *fault_args(MAX_STEPS, BATCH, N_SAMPLES, HEALTH_TIMEOUT),
        "valid_dataset.path=synthetic://arith?digits=1&steps=2&n=8&seed=1",
        "valid_dataset.batch_size=8",
        "gconfig.max_new_tokens=16",
        "actor.ppo_n_minibatches=1",
    ]

    def cut():
        rc.net.set_link("c", False)
        try:
            time.sleep(30)
        finally:
            rc.net.set_link("c", True)

    # stop_when is first checked once the link is back: THEN_STEPS steps after that
    out = run_with_fault(
        tmp_path, cmd, rc.env, trial, cut, netns=rc.net["a"].netns,
        stop_when=stat_at_least("rollout/server_restarts_total"), then_steps=THEN_STEPS,
    )  # fmt: skip
    stats = assert_no_sample_lost_or_duplicated(tmp_path, trial, None, BATCH, N_SAMPLES)
    c_addr, b_addr = re.escape(ips["c"]), re.escape(ips["b"])
    # the log names C's server and what timed out, then the node it gave up
    assert re.search(rf"inference server {c_addr}:\d+ marked unhealthy", out), out[-6000:]
    assert re.search(rf"inference server rollout/1 \({c_addr}:\d+\)", out), out[-6000:]
    assert f"(health_check_timeout={HEALTH_TIMEOUT})" in out, out[-6000:]
    assert f"Ray node {ips['c']}" in out, out[-6000:]
    # B's server answered throughout; C's was restarted on B
    assert not re.search(rf"{b_addr}:\d+ marked unhealthy", out), out[-6000:]
    assert f"Worker rollout/1 restarted on Ray node {ips['b']} " in out, out[-6000:]
    assert stats[-1]["rollout/server_restarts_total"] >= 1, stats[-1]
    assert stats[-1]["rollout/servers_healthy"] >= 2, stats[-1]
