"""A 30 s link cut of an inference node on a Slurm cluster of network namespaces.

Same set-up as ``tests/test_node_faults.py`` (node A: the training worker; B and C: one
inference server each), with ``SlurmdTimeout=60``: longer than the cut, as Slurm's
default (300 s) is, so slurmctld never declares node C down and leaves its task alone.
Node C's link goes down for 30 s after step 1, then up. Expected: the run finishes with
no sample lost or duplicated; B's server never leaves the rotation; the log names C's
server, its node and the health deadline that expired; the watchdog gives C's server up
and replaces it on B, and once the link is back and the old process answers on its
address again, readmits it (beside its replacement) with the current weights, which the
next weight versions' fingerprint checks confirm on 3 servers.

(A cut longer than ``SlurmdTimeout``: the node is set down, its tasks are taken out of
the job and killed when it returns; the server is then only replaced.)
"""

from __future__ import annotations

import re
import time

import pytest
from node_fault_checks import (
    MAX_STEPS,
    assert_no_sample_lost_or_duplicated,
    run_with_fault,
    slurm_fault_command,
    stat_at_least,
)
from slurm_fixture import netns_slurm

# the run lasts until C's old server is readmitted, then THEN_STEPS steps (each verifies a
# weight version on every server), then the test stops it (SIGTERM)
THEN_STEPS = 3
BATCH = 4
N_SAMPLES = 2
HEALTH_TIMEOUT = 5

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def slurm_slow_timeout(tmp_path_factory):
    with netns_slurm(
        str(tmp_path_factory.mktemp("slurmcut")), nodes=("a", "b", "c"), slurmd_timeout=60
    ) as c:
        yield c


def test_inference_node_link_cut_30s_run_finishes_server_readmitted_log_names_node(
    slurm_slow_timeout, tmp_path
):
    cluster, env, _root = slurm_slow_timeout

    def cut():
        cluster.set_link("c", False)
        try:
            time.sleep(30)
        finally:
            cluster.set_link("c", True)

    out = run_with_fault(
        tmp_path,
        slurm_fault_command(tmp_path, "link-cut", MAX_STEPS, BATCH, N_SAMPLES, HEALTH_TIMEOUT),
        env, "link-cut", cut,
        stop_when=stat_at_least("rollout/server_readmits_total"), then_steps=THEN_STEPS,
    )  # fmt: skip
    stats = assert_no_sample_lost_or_duplicated(tmp_path, "link-cut", None, BATCH, N_SAMPLES)
    # the log names the server on node C and what timed out
    assert re.search(rf"inference server rollout/\d \({re.escape(cluster['c'].addr)}:\d+\)", out), (
        out[-6000:]
    )
    assert "on Slurm node nc" in out, out[-6000:]
    assert f"(health_check_timeout={HEALTH_TIMEOUT})" in out, out[-6000:]
    # node B's server answered throughout: it never left the rotation
    assert not re.search(rf"{re.escape(cluster['b'].addr)}:\d+ marked unhealthy", out), out[-6000:]
    # C's old server, alive behind the cut, was readmitted once the link was back (beside
    # its replacement), with the current weights: later versions verified on 3 servers
    c_addr = re.escape(cluster["c"].addr)
    m = re.search(rf"rollout/\d's old process at ({c_addr}:\d+) answers again", out)
    assert m, out[-6000:]
    after = out[m.end() :]
    assert re.search(r"weights of version \d+ verified on 3 server\(s\)", after), after[-6000:]
    assert stats[-1]["rollout/server_readmits_total"] >= 1, stats[-1]
    assert stats[-1]["rollout/servers_healthy"] == 3, stats[-1]
