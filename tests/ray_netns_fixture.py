"""A three-node Ray cluster in the network namespaces of ``tests/netns_cluster.py``.

``start_ray_cluster(cluster, root)`` runs, with ``--block`` so each stays a child of the
test (the fixture owns it):

- node A: ``ray start --head --node-ip-address <A> --port 6379`` (a namespace has its
  own ports, so the default port never collides with another Ray on the host);
- nodes B, C: ``ray start --address <A>:6379 --node-ip-address <B|C>``;

each with its own ``--temp-dir`` (short: Ray's socket paths must stay under 108 bytes),
``--num-cpus``, no dashboard. Ray 2.60 turns token authentication on by itself for a head
started with ``ray start`` (``RAY_AUTH_MODE`` unset): worker nodes and drivers then need
the same token. The fixture sets ``RAY_AUTH_MODE=token`` and a fresh ``RAY_AUTH_TOKEN``
for every process it starts (never the shared ``~/.ray/auth_token``), and hands the same
environment to the driver (``RayNetnsCluster.env``). It returns once ``ray status`` on the
head counts every node alive.

``stop_ray_cluster`` ends the ``ray start --block`` processes (SIGTERM, which stops the
node's raylet / GCS / workers), then kills what is left in the namespaces
(``NetnsCluster.kill_node``); it never runs ``ray stop`` (which would stop every Ray of
the host). ``ray_netns_cluster`` (module fixture) builds the namespaces too and tears
everything down in a ``finally``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from netns_cluster import NetnsCluster, create_cluster, destroy_cluster, netns_skip_reason

RAY_PORT = 6379


def ray_bin() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def ray_skip_reason() -> str | None:
    if not os.path.exists(ray_bin()) and shutil.which("ray") is None:
        return "the `ray` command is missing (the dev extra installs ray)"
    return None


@dataclass
class RayNetnsCluster:
    net: NetnsCluster
    root: str  # logs of the `ray start` processes
    head: str  # "A:6379"
    env: dict[str, str]  # RAY_ADDRESS + auth settings, for drivers
    node_ips: dict[str, str]  # node name -> address
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    temp_dirs: dict[str, str] = field(default_factory=dict)

    def status(self, timeout: float = 30) -> str:
        out = self.net.run(
            "a", [ray_bin(), "status", f"--address={self.head}"], env=self.env, timeout=timeout
        )
        return out.stdout + out.stderr

    def log_tails(self, n: int = 30) -> str:
        parts = []
        for name in self.procs:
            path = os.path.join(self.root, f"ray-start-{name}.log")
            try:
                with open(path, errors="replace") as f:
                    parts.append(f"--- {path}\n" + "".join(f.readlines()[-n:]))
            except OSError:
                pass
        return "\n".join(parts)


def _alive_nodes(status: str) -> int:
    """Nodes listed under ``Active:`` in ``ray status`` output."""
    lines = status.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Active:")
    except StopIteration:
        return 0
    n = 0
    for line in lines[start + 1 :]:
        if not line.strip().startswith("1 node_"):
            break
        n += 1
    return n


def start_ray_cluster(
    net: NetnsCluster, root: str, num_cpus: int = 4, timeout: float = 180.0
) -> RayNetnsCluster:
    """Start the head on node A and a worker node on each other node; wait until all are alive."""
    os.makedirs(root, exist_ok=True)
    head = f"{net['a'].addr}:{RAY_PORT}"
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ADDRESS=head,
    )
    env.pop("RAY_NODE_IP_ADDRESS", None)
    rc = RayNetnsCluster(
        net=net, root=root, head=head, env=env, node_ips={n: net[n].addr for n in net.nodes}
    )
    for name in net.nodes:
        # short and unique: /tmp/r<tag><node>; Ray appends session_*/sockets/...
        temp_dir = f"/tmp/r{net.tag}{name}"
        rc.temp_dirs[name] = temp_dir
        argv = [
            ray_bin(),
            "start",
            "--block",
            f"--node-ip-address={net[name].addr}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        if name == "a":
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={head}"]
        log = open(os.path.join(root, f"ray-start-{name}.log"), "wb")  # noqa: SIM115
        rc.procs[name] = net.popen(
            name, argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        if name == "a":
            net.wait_port("a", RAY_PORT, timeout=timeout)
    deadline = time.monotonic() + timeout
    status = ""
    while time.monotonic() < deadline:
        for name, p in rc.procs.items():
            if p.poll() is not None:
                raise RuntimeError(
                    f"`ray start` on node {name} exited with {p.returncode}\n{rc.log_tails()}"
                )
        try:
            status = rc.status()
        except subprocess.TimeoutExpired:
            status = ""
        if _alive_nodes(status) == len(net.nodes):
            return rc
        time.sleep(1)
    raise TimeoutError(
        f"Ray nodes not all alive within {timeout} s; `ray status`:\n{status}\n{rc.log_tails()}"
    )


def stop_ray_cluster(rc: RayNetnsCluster) -> None:
    """Stop the nodes this fixture started (never ``ray stop``), workers first."""
    for name in sorted(rc.procs, reverse=True):  # c, b, then the head
        p = rc.procs[name]
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for name, p in rc.procs.items():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        rc.net.kill_node(name)  # whatever Ray left behind in this node (only ours live there)
    for d in rc.temp_dirs.values():
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_netns_cluster(tmp_path_factory) -> Iterator[RayNetnsCluster]:
    reason = netns_skip_reason() or ray_skip_reason()
    if reason:
        pytest.skip(reason)
    root = str(tmp_path_factory.mktemp("ray3n"))
    net = create_cluster(n_nodes=3)
    rc = None
    try:
        rc = start_ray_cluster(net, root)
        yield rc
    finally:
        if rc is not None:
            stop_ray_cluster(rc)
        destroy_cluster(net)
