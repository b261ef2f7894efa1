"""The network-namespace cluster fixture (tests/netns_cluster.py): real links, real isolation."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from netns_cluster import create_cluster, destroy_cluster, netns_skip_reason

pytestmark = pytest.mark.skipif(netns_skip_reason() is not None, reason=str(netns_skip_reason()))

# A one-connection-at-a-time TCP server that answers its own node name.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()
"""

CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as c:
        print("got", c.recv(64).decode())
except OSError as e:
    print("refused", type(e).__name__)
"""


def _serve(cluster, node, host, port, answer):
    proc = cluster.popen(
        node,
        [sys.executable, "-c", SERVER, host, str(port), answer],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _connect(cluster, node, host, port) -> str:
    out = cluster.run(node, [sys.executable, "-c", CLIENT, host, str(port)], timeout=30)
    return out.stdout.strip()


def test_netns_cluster_node_address_reachable_across_nodes_loopback_not(netns_cluster):
    c = netns_cluster
    a = c["a"]
    assert len({n.addr for n in c.nodes.values()}) == 3
    port = 18765  # a fresh namespace has its own, empty, port space
    on_addr = _serve(c, "a", a.addr, port, "A-addr")
    on_lo = _serve(c, "a", "127.0.0.1", port + 1, "A-lo")
    try:
        # B and C reach A's server on A's address; so does the root namespace (the bridge).
        assert _connect(c, "b", a.addr, port) == "got A-addr"
        assert _connect(c, "c", a.addr, port) == "got A-addr"
        c.wait_port("a", port, timeout=5)
        # A's loopback is A's own: from B, 127.0.0.1 is B's loopback, where nothing listens.
        assert _connect(c, "a", "127.0.0.1", port + 1) == "got A-lo"
        assert _connect(c, "b", "127.0.0.1", port + 1).startswith("refused")
        # A server bound to A's loopback is not exposed on A's address either.
        assert _connect(c, "b", a.addr, port + 1).startswith("refused")
        # A cut link isolates the node; restoring it brings it back.
        c.set_link("a", up=False)
        assert _connect(c, "b", a.addr, port).startswith("refused")
        c.set_link("a", up=True)
        deadline = time.monotonic() + 10
        while _connect(c, "b", a.addr, port) != "got A-addr":
            assert time.monotonic() < deadline, "link did not come back"
            time.sleep(0.2)
        # kill_node kills every process of the node.
        killed = c.kill_node("a")
        assert on_addr.pid in killed and on_lo.pid in killed
        assert on_addr.wait(timeout=10) != 0 and on_lo.wait(timeout=10) != 0
    finally:
        on_addr.kill()
        on_lo.kill()


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_netns_cluster_teardown_after_failure_removes_everything():
    cluster = create_cluster(n_nodes=2)
    sleeper = None
    try:
        sleeper = cluster.popen("a", ["sleep", "600"])
        orphan = cluster.popen("b", ["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE)
        orphan_pid = int(orphan.stdout.readline())
        assert cluster["a"].netns in _netns() and cluster.bridge in _links()
        with pytest.raises(RuntimeError):
            try:
                raise RuntimeError("test body failed")
            finally:
                destroy_cluster(cluster)
    finally:
        destroy_cluster(cluster)  # idempotent
    assert sleeper.poll() is not None
    assert not os.path.exists(f"/proc/{orphan_pid}") or _zombie(orphan_pid)
    assert cluster.tag not in _netns()
    assert cluster.bridge not in _links() and cluster["a"].host_veth not in _links()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
