"""The GRPO demo on a two-node Slurm cluster made of network namespaces.

``slurm_two_nodes`` starts ``slurmctld`` in the root namespace (the "login node",
``SlurmctldAddr`` = the bridge address) and one ``slurmd -N n<x>`` inside namespaces A
and B of ``tests/netns_cluster.py`` (``NodeAddr`` = the namespace's address); spool, pid
and log files are per node (``%n``). The demo runs with the training worker pinned to
node A and the inference server to node B (``scheduling_spec.0.nodelist``), so every
request and every weight update crosses the bridge.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import pytest
from netns_cluster import create_cluster, destroy_cluster, netns_skip_reason
from slurm_fixture import _log_tail, _stop, demo_command, slurm_skip_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = ("a", "b")

pytestmark = pytest.mark.slow


def _conf(root: str, cluster, ctld_port: int, d_port: int) -> str:
    for d in ("state", "spool", "log", "run"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName=n{n} NodeAddr={cluster[n].addr} NodeHostname={host} "
        "CPUs=16 RealMemory=65536 State=UNKNOWN"
        for n in NODES
    )
    conf = f"""\
ClusterName=areal-2n
SlurmctldHost={host}({cluster.host_addr})
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes={",".join("n" + n for n in NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    path = os.path.join(root, "slurm.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory):
    reason = netns_skip_reason() or slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    root = str(tmp_path_factory.mktemp("slurm2n"))
    cluster = create_cluster(n_nodes=2)
    ctld = None
    slurmds = {}
    env = {}
    try:
        conf = _conf(root, cluster, _free_port(cluster.host_addr), _free_port("127.0.0.1"))
        env = dict(os.environ, SLURM_CONF=conf)
        logs = open(os.path.join(root, "log", "daemons.out"), "ab")  # noqa: SIM115
        ctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", conf], env=env, stdout=logs, stderr=logs
        )
        for n in NODES:
            os.makedirs(os.path.join(root, "spool", f"n{n}"), exist_ok=True)
            # nsenter, not `ip netns exec`: the latter remounts /sys for the namespace,
            # which hides /sys/fs/cgroup, and slurmd 22.05 refuses to start without it.
            slurmds[n] = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{cluster[n].netns}",
                 "slurmd", "-D", "-N", f"n{n}", "-f", conf],
                env=env, stdout=logs, stderr=logs,
            )  # fmt: skip
        deadline = time.monotonic() + 90
        states = ""
        while time.monotonic() < deadline:
            for name, p in [
                ("slurmctld", ctld),
                *((f"slurmd-n{n}", p) for n, p in slurmds.items()),
            ]:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {p.returncode}:\n"
                        + _log_tail(os.path.join(root, "log", f"{name}.log"))
                        + _log_tail(os.path.join(root, "log", "daemons.out"))
                    )
            try:
                states = subprocess.run(
                    ["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True,
                    text=True, timeout=10,
                ).stdout  # fmt: skip
            except subprocess.TimeoutExpired:
                states = ""
            if states.count("idle") == len(NODES):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(
                f"Slurm nodes not idle within 90 s (sinfo: {states!r})\n"
                + _log_tail(os.path.join(root, "log", "slurmctld.log"))
                + "".join(_log_tail(os.path.join(root, "log", f"slurmd-n{n}.log")) for n in NODES)
            )
        yield cluster, env, root
    finally:
        if ctld is not None and ctld.poll() is None:
            subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=20, check=False)
            time.sleep(2)
        for n, p in slurmds.items():
            _stop(p, os.path.join(root, "run", f"slurmd-n{n}.pid"))
        _stop(ctld, os.path.join(root, "run", "slurmctld.pid"))
        destroy_cluster(cluster)


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
