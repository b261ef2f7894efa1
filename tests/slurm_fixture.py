"""A real single-node Slurm cluster for tests (Debian's ``slurm-wlm``, run as root).

``slurm_cluster`` (session fixture) writes ``slurm.conf`` into a temp dir
(``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
``SelectType=select/cons_tres``, ``AuthType=auth/none`` + ``CredType=cred/none``, so no
munge daemon is needed; node = this host declared with 16 CPUs and 64 GB
(``SlurmdParameters=config_overrides``: logical, so several test jobs fit on 2 cores); state, spool,
log and pid files under the temp dir; free ports), starts ``slurmctld -D`` and
``slurmd -D`` as child processes, waits until ``sinfo`` shows the node idle, sets
``SLURM_CONF`` for the session and yields a ``SlurmCluster``. Teardown cancels every
job, stops both daemons (SIGTERM, then SIGKILL) and restores ``SLURM_CONF``.

Skips with a reason when not root or the binaries are missing (``.ci/run`` installs
``slurm-wlm`` and ``munge``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol")


@dataclass
class SlurmCluster:
    conf: str
    root: str
    node: str
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 30) -> str:
        out = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=True
        )
        return out.stdout

    def jobs(self) -> list[str]:
        """Ids of jobs that squeue still lists."""
        return self.run("squeue", "-h", "-o", "%i").split()


def _free_port() -> int:
    """A port free on every address (slurmctld and slurmd bind the wildcard address)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_slurmctld(conf: str, env: dict, logs, root: str, tries: int = 3) -> subprocess.Popen:
    """``slurmctld -D`` on ``conf``. The port in ``conf`` was free when it was chosen, but
    another process (the tests run two at a time) may take it before slurmctld binds it:
    slurmctld then exits at once with "Address already in use", and it is started again
    on a new port (``SlurmctldPort`` rewritten; no slurmd has read the file yet)."""
    log = os.path.join(root, "log", "slurmctld.log")
    for attempt in range(tries):
        start = os.path.getsize(log) if os.path.exists(log) else 0
        ctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", conf], env=env, stdout=logs, stderr=logs
        )
        deadline = time.monotonic() + 3  # the bind is the first thing it does
        while time.monotonic() < deadline and ctld.poll() is None:
            time.sleep(0.1)
        if ctld.poll() is None or attempt == tries - 1:
            return ctld
        with open(log, errors="replace") as f:
            f.seek(start)
            if "Address already in use" not in f.read():
                return ctld  # another failure: wait_idle reports it with the log
        with open(conf) as f:
            text = f.read()
        old = next(ln for ln in text.splitlines() if ln.startswith("SlurmctldPort="))
        with open(conf, "w") as f:
            f.write(text.replace(old, f"SlurmctldPort={_free_port()}"))
    return ctld


def slurm_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "Slurm test cluster needs root (slurmd runs jobs as root here)"
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm binaries missing: {missing} (apt-get install -y slurm-wlm munge)"
    return None


def write_slurm_conf(
    root: str,
    nodes: list[tuple[str, str | None]],
    ctld_host: str,
    *,
    cpus: int = 16,
    mem_mb: int = 65536,
    ctld_port: int | None = None,
    d_port: int | None = None,
    slurmd_timeout: int = 30,
) -> str:
    """Write ``root/slurm.conf``; ``nodes`` = ``[(name, NodeAddr or None)]``.

    ``ctld_host``: ``SlurmctldHost`` (``host`` or ``host(addr)``). Spool, pid and log files
    are per node (``%n``) since every node shares ``root``. Returns the file's path.
    """
    for d in ("state", "spool", "log", "run"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    host = socket.gethostname()
    lines = "\n".join(
        f"NodeName={name}"
        + (f" NodeAddr={addr} NodeHostname={host}" if addr else "")
        + f" CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN"
        for name, addr in nodes
    )
    conf = f"""\
ClusterName=areal-{len(nodes)}n
SlurmctldHost={ctld_host}
SlurmctldPort={ctld_port or _free_port()}
SlurmdPort={d_port or _free_port()}
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
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmdParameters=config_overrides
{lines}
PartitionName=debug Nodes={",".join(n for n, _ in nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    path = os.path.join(root, "slurm.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def _stop(proc: subprocess.Popen | None, pid_file: str) -> None:
    pids = set()
    if proc is not None and proc.poll() is None:
        pids.add(proc.pid)
    try:
        with open(pid_file) as f:
            pids.add(int(f.read().strip()))
    except (OSError, ValueError):
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if proc is not None and proc.pid == pid and proc.poll() is not None:
                break
            time.sleep(0.1)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _log_tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def wait_idle(root: str, env: dict, daemons: dict, n_nodes: int, timeout: float) -> None:
    """Wait until ``sinfo`` shows ``n_nodes`` idle nodes; a daemon that exits meanwhile
    (``daemons``: log name -> process) or the deadline raises, with the logs' tails."""
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        for name, p in daemons.items():
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
        if states.count("idle") == n_nodes:
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"Slurm nodes not idle within {timeout:.0f} s (sinfo: {states!r})\n"
        + "".join(_log_tail(os.path.join(root, "log", f"{name}.log")) for name in daemons)
    )


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    root = str(tmp_path_factory.mktemp("slurm"))
    node = socket.gethostname()
    conf = write_slurm_conf(root, [(node, None)], node)
    os.makedirs(os.path.join(root, "spool", node), exist_ok=True)
    env = dict(os.environ, SLURM_CONF=conf)
    old_conf = os.environ.get("SLURM_CONF")
    ctld = slurmd = None
    cluster = SlurmCluster(conf=conf, root=root, node=node, env=env)
    try:
        logs = open(os.path.join(root, "log", "daemons.out"), "ab")  # noqa: SIM115
        ctld = start_slurmctld(conf, env, logs, root)
        slurmd = subprocess.Popen(["slurmd", "-D", "-f", conf], env=env, stdout=logs, stderr=logs)
        wait_idle(root, env, {"slurmctld": ctld, f"slurmd-{node}": slurmd}, 1, timeout=60)
        os.environ["SLURM_CONF"] = conf
        yield cluster
    finally:
        try:
            if ctld is not None and ctld.poll() is None:
                subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=20)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and cluster.jobs():
                    time.sleep(0.5)
        except Exception:  # noqa: BLE001 - teardown continues
            pass
        _stop(slurmd, os.path.join(root, "run", f"slurmd-{node}.pid"))
        _stop(ctld, os.path.join(root, "run", "slurmctld.pid"))
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf


def demo_command(tmp_path, scheduler_type: str) -> list[str]:
    """The CPU GRPO demo, 2 steps on tiny data, 1 server + 1 training worker."""
    return [
        sys.executable,
        os.path.join(REPO, "examples/math/gsm8k_rl.py"),
        "--config",
        os.path.join(REPO, "examples/math/gsm8k_grpo_cpu.yaml"),
        f"scheduler.type={scheduler_type}",
        "allocation_mode=local:d1+fsdp:d1",
        f"cluster.fileroot={tmp_path}",
        f"trial_name=e2e-{scheduler_type}",
        "total_train_steps=2",
        "train_dataset.batch_size=4",
        "train_dataset.path=synthetic://arith?digits=1&steps=2&n=64&seed=0",
        "valid_dataset.path=synthetic://arith?digits=1&steps=2&n=8&seed=1",
        "valid_dataset.batch_size=8",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=16",
        "evaluator.freq_steps=null",
        "recover.mode=disabled",
        "actor.ppo_n_minibatches=1",
    ]


# ---------------------------------------------------------------------------- multi-node
def start_slurmd(cluster, node: str, conf: str, env: dict, logs) -> subprocess.Popen:
    """``slurmd -N n<node>`` inside ``node``'s namespace (``nsenter``, not ``ip netns exec``:
    the latter remounts /sys for the namespace, which hides /sys/fs/cgroup, and slurmd
    22.05 refuses to start without it)."""
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{cluster[node].netns}",
         "slurmd", "-D", "-N", f"n{node}", "-f", conf],
        env=env, stdout=logs, stderr=logs,
    )  # fmt: skip


@contextlib.contextmanager
def netns_slurm(root: str, nodes=("a", "b"), slurmd_timeout: int = 30):
    """A Slurm cluster over network namespaces (``tests/netns_cluster.py``): ``slurmctld``
    in the root namespace (``SlurmctldAddr`` = the bridge address), one ``slurmd -N n<x>``
    per namespace (``NodeAddr`` = its address); spool, pid and log files per node (``%n``).
    Yields ``(cluster, env, root)`` once ``sinfo`` shows every node idle; stops the daemons
    and removes the namespaces afterwards, even when the test failed."""
    from netns_cluster import create_cluster, destroy_cluster, netns_skip_reason

    reason = netns_skip_reason() or slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = create_cluster(n_nodes=len(nodes))
    ctld = None
    slurmds = {}
    env = {}
    try:
        conf = write_slurm_conf(
            root,
            [(f"n{n}", cluster[n].addr) for n in nodes],
            f"{socket.gethostname()}({cluster.host_addr})",
            ctld_port=_free_port(),
            slurmd_timeout=slurmd_timeout,
        )
        env = dict(os.environ, SLURM_CONF=conf)
        logs = open(os.path.join(root, "log", "daemons.out"), "ab")  # noqa: SIM115
        ctld = start_slurmctld(conf, env, logs, root)
        for n in nodes:
            os.makedirs(os.path.join(root, "spool", f"n{n}"), exist_ok=True)
            slurmds[n] = start_slurmd(cluster, n, conf, env, logs)
        daemons = {"slurmctld": ctld, **{f"slurmd-n{n}": p for n, p in slurmds.items()}}
        wait_idle(root, env, daemons, len(nodes), timeout=90)
        yield cluster, env, root
    finally:
        if ctld is not None and ctld.poll() is None:
            subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=20, check=False)
            time.sleep(2)
        for n, p in slurmds.items():
            # a node the test killed: its pid file names a dead (maybe reused) pid
            _stop(p, os.path.join(root, "run", f"slurmd-n{n}.pid") if p.poll() is None else "")
        _stop(ctld, os.path.join(root, "run", "slurmctld.pid"))
        destroy_cluster(cluster)
