"""A three-node test cluster made of Linux network namespaces (needs root and ``ip``).

``netns_cluster`` (session fixture) creates, for one test session:

- a Linux bridge ``arb<tag>`` in the root namespace holding ``10.213.<x>.254/24``
  (the "login node": the test process itself reaches every node through it);
- three namespaces ``areal-<tag>-a`` / ``-b`` / ``-c``, each joined to the bridge by a
  veth pair (``arv<tag><node>`` in the root namespace, ``eth0`` inside) with the address
  ``10.213.<x>.1`` / ``.2`` / ``.3`` and its own loopback up.

``<tag>`` (creator pid + two random bytes) is unique per cluster and ``<x>`` is picked
among the /24s no interface of this host uses, so two clusters on one host do not
collide. The nodes share the file system (as cluster nodes share NFS) but not the
network: ``127.0.0.1`` inside node A is A's own loopback, unreachable from B.

``NetnsCluster.popen(node, argv)`` runs a command inside a node (``ip netns exec``);
``kill_node`` kills every process of a node (``ip netns pids``); ``set_link`` cuts or
restores a node's link. Teardown runs in a ``finally``: it kills every process left in
the namespaces, deletes them (which removes their veth pairs) and the bridge, even when
the test failed or was interrupted. Leftovers of a session that died without teardown
(its pid in the tag is gone) are removed at the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

PREFIX = "areal-"
NODE_NAMES = ("a", "b", "c")


def netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network-namespace cluster needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip *args``; with ``check``, a failure raises with ``ip``'s own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def _new_tag() -> str:
    """``<pid>x<4 hex>``, used by no interface on this host (call under ``_host_lock``).

    A process may build several clusters (the session fixture and a test's own); two
    random bytes plus the check keep their interface names apart. Interface names must
    stay <= 15 characters: ``arv`` + 5 + 1 + 4 + node letter = 14.
    """
    existing = _ip("-o", "link", "show", check=False).stdout
    while True:
        tag = f"{os.getpid() % 100000}x{secrets.token_hex(2)}"
        if f"arb{tag}" not in existing and f"arv{tag}" not in existing:
            return tag


@dataclass
class Node:
    name: str  # "a", "b", "c"
    netns: str  # namespace name
    addr: str  # the node's address on the private subnet
    host_veth: str  # the veth end in the root namespace (on the bridge)


@dataclass
class NetnsCluster:
    tag: str
    subnet: str  # e.g. "10.213.57.0/24"
    bridge: str
    host_addr: str  # the bridge's address (the root namespace's side)
    nodes: dict[str, Node]
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def popen(self, node: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace; killed at teardown if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[node].netns, *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, node: str, argv: Sequence[str], timeout: float = 60, **kwargs):
        """``subprocess.run`` inside ``node`` (text output captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(
            ["ip", "netns", "exec", self.nodes[node].netns, *argv], timeout=timeout, **kwargs
        )

    def pids(self, node: str) -> list[int]:
        out = _ip("netns", "pids", self.nodes[node].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process in ``node``'s namespace; returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def set_link(self, node: str, up: bool) -> None:
        """Cut (``up=False``) or restore ``node``'s link to the bridge."""
        _ip("link", "set", self.nodes[node].host_veth, "up" if up else "down")

    def wait_port(self, node: str, port: int, timeout: float = 30.0) -> None:
        """Wait until something accepts TCP connections on ``node``'s address:``port``."""
        import socket

        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((self.nodes[node].addr, port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"nothing listens on {self.nodes[node].addr}:{port} (node {node}) "
                        f"after {timeout} s"
                    ) from None
                time.sleep(0.1)


def _used_third_octets() -> set[int]:
    out = _ip("-o", "-4", "addr", "show").stdout
    used = set()
    for addr in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out):
        ip = ipaddress.ip_address(addr)
        if ip in ipaddress.ip_network("10.213.0.0/16"):
            used.add(int(addr.split(".")[2]))
    return used


def _remove_stale() -> None:
    """Delete namespaces/bridges of earlier sessions whose creating process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)x[0-9a-f]+-[a-z]", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete_netns(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.search(r"^\d+: (arb(\d+)x[0-9a-f]+)[:@]", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _ip("link", "del", m.group(1), check=False)


def _delete_netns(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", name, check=False)


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Serialize cluster creation across the processes of this host (pytest-xdist workers).

    Between picking a free /24 and putting it on a bridge, another worker could pick the
    same one; under this lock the pick and the bridge's address are one step.
    """
    with open(os.path.join(tempfile.gettempdir(), "areal-netns-cluster.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def create_cluster(n_nodes: int = 3) -> NetnsCluster:
    """Build the namespaces, veth pairs and bridge (call ``destroy_cluster`` afterwards)."""
    cluster = None
    try:
        with _host_lock():
            _remove_stale()
            tag = _new_tag()
            free = sorted(set(range(10, 250)) - _used_third_octets())
            net = f"10.213.{free[secrets.randbelow(len(free))]}"
            cluster = NetnsCluster(
                tag=tag,
                subnet=f"{net}.0/24",
                bridge=f"arb{tag}",
                host_addr=f"{net}.254",
                nodes={},
            )
            _ip("link", "add", cluster.bridge, "type", "bridge")
            _ip("addr", "add", f"{cluster.host_addr}/24", "dev", cluster.bridge)
        _ip("link", "set", cluster.bridge, "up")
        for i, name in enumerate(NODE_NAMES[:n_nodes]):
            node = Node(name, f"{PREFIX}{tag}-{name}", f"{net}.{i + 1}", f"arv{tag}{name}")
            cluster.nodes[name] = node
            _ip("netns", "add", node.netns)
            _ip(
                "link",
                "add",
                node.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                node.netns,
            )
            _ip("link", "set", node.host_veth, "master", cluster.bridge, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
    except BaseException:
        if cluster is not None:
            destroy_cluster(cluster)
        raise
    return cluster


def destroy_cluster(cluster: NetnsCluster) -> None:
    for proc in cluster._procs:
        if proc.poll() is None:
            proc.kill()
    for node in cluster.nodes.values():
        _delete_netns(node.netns)
        _ip("link", "del", node.host_veth, check=False)
    _ip("link", "del", cluster.bridge, check=False)
    for proc in cluster._procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="session")
def netns_cluster() -> Iterator[NetnsCluster]:
    reason = netns_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = create_cluster()
    try:
        yield cluster
    finally:
        destroy_cluster(cluster)


def etcd_skip_reason() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd missing (apt-get install -y etcd-server; .ci/run installs it)"
    return None


def start_etcd(
    data_dir: str, host: str, client_port: int, peer_port: int, popen=subprocess.Popen
) -> subprocess.Popen:
    """Start a one-member etcd (Debian's ``etcd-server``) serving ``http://host:client_port``.

    ``popen`` runs it where it should live (``subprocess.Popen`` for the root namespace,
    ``functools.partial(cluster.popen, "a")`` for node A). Returns once ``/health`` answers.
    """
    import json
    import urllib.request

    os.makedirs(data_dir, exist_ok=True)
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    log = open(os.path.join(data_dir, "etcd.log"), "w")
    proc = popen(
        [
            "etcd",
            "--name=areal-test",
            f"--data-dir={os.path.join(data_dir, 'data')}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=areal-test={peer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            with open(os.path.join(data_dir, "etcd.log")) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"etcd exited with {proc.returncode}: {tail}")
        try:
            with urllib.request.urlopen(client + "/health", timeout=1) as r:
                if json.loads(r.read()).get("health") == "true":
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"etcd at {client} not healthy after 60 s")
        time.sleep(0.2)


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
