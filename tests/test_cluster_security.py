"""Security across nodes: a process on another node without the secret gets 401, nothing runs.

Node A (tests/netns_cluster.py) runs an RPC worker, the built-in server and the agent
proxy, each bound to A's address; node B, with no run secret and no admin key, calls
their control and admin endpoints. Every such call is 401, the pickled payload that
would create a file is never unpickled, the server's state is unchanged; the same calls
with the secret / key from node B do get through (so the 401 is the check, not the
network). Every listening socket of node A is on A's address, none on 0.0.0.0.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from areal.models.tiny import get_tiny_base_path
from areal.utils.auth import PROXY_ADMIN_KEY_ENV, RUN_SECRET_ENV, get_run_secret

RPC_PORT, SERVER_PORT, PROXY_PORT = 18100, 18200, 18300  # node A's own port space

# Runs on node B: POSTs each (url, body hex, headers) and prints the statuses as JSON.
CLIENT = """
import json, sys, urllib.request, urllib.error
out = []
for url, body, headers in json.loads(sys.argv[1]):
    req = urllib.request.Request(url, data=bytes.fromhex(body) if body is not None else None,
                                 headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            out.append([r.status, r.read().decode(errors="replace")[:300]])
    except urllib.error.HTTPError as e:
        out.append([e.code, e.read().decode(errors="replace")[:300]])
    except OSError as e:
        out.append([0, repr(e)])
print(json.dumps(out))
"""


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _from_node(cluster, node, calls, env):
    payload = [[u, None if b is None else b.hex(), h] for u, b, h in calls]
    r = cluster.run(node, [sys.executable, "-c", CLIENT, json.dumps(payload)], env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout)]


def _listening(cluster, node) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket in ``node``'s namespace (/proc/net/tcp)."""
    out = cluster.run(node, ["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout
    socks = set()
    for line in out.splitlines():
        f = line.split()
        if len(f) > 3 and f[3] == "0A" and ":" in f[1]:  # st 0A = LISTEN
            hexaddr, hexport = f[1].split(":")
            if len(hexaddr) == 8:
                addr = ".".join(str(int(hexaddr[i : i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                addr = "::" if int(hexaddr, 16) == 0 else hexaddr
            socks.add((addr, int(hexport, 16)))
    return socks


def _wait_http(url, proc, timeout=240):
    """Poll ``url`` from the test process (the root namespace reaches every node via the bridge)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            pass
        assert proc.poll() is None, f"{url}: the process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{url} not up after {timeout} s"
        time.sleep(0.3)


@pytest.mark.slow
def test_cluster_other_node_without_secret_gets_401_nothing_runs(netns_cluster, tmp_path):
    c = netns_cluster
    a = c["a"].addr
    secret = get_run_secret()
    assert secret, "conftest creates the session's run secret"
    model = get_tiny_base_path()
    env_a = dict(os.environ, OMP_NUM_THREADS="1", **{PROXY_ADMIN_KEY_ENV: "cross-node-admin"})
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("rpc", "server", "proxy")}
    procs = []
    try:
        procs.append(
            c.popen(
                "a",
                [sys.executable, "-m", "areal.infra.rpc.rpc_server", "--host", a, "--port", str(RPC_PORT)],
                env=env_a, stdout=logs["rpc"], stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        procs.append(
            c.popen(
                "a",
                [sys.executable, "-m", "areal.inference.server", "--model-path", model,
                 "--host", a, "--port", str(SERVER_PORT)],
                env=env_a, stdout=logs["server"], stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        procs.append(
            c.popen(
                "a",
                [sys.executable, "-m", "areal.experimental.openai.proxy",
                 "--server-addrs", f"{a}:{SERVER_PORT}", "--tokenizer", model,
                 "--host", a, "--port", str(PROXY_PORT)],
                env=env_a, stdout=logs["proxy"], stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        # All three start at once (the proxy waits for the server's health itself).
        _wait_http(f"http://{a}:{SERVER_PORT}/health", procs[1])
        _wait_http(f"http://{a}:{RPC_PORT}/health", procs[0])
        _wait_http(f"http://{a}:{PROXY_PORT}/health", procs[2])

        # Node B: no run secret, no admin key in its environment.
        env_b = {
            k: v for k, v in os.environ.items() if k not in (RUN_SECRET_ENV, PROXY_ADMIN_KEY_ENV)
        }
        marker = tmp_path / "pwned"
        evil = pickle.dumps({"engine": _Evil(str(marker)), "args": [], "kwargs": {}})
        rpc, srv, prx = (f"http://{a}:{p}" for p in (RPC_PORT, SERVER_PORT, PROXY_PORT))
        js = json.dumps({"version": 99}).encode()
        wrong = {"Authorization": "Bearer not-the-secret", "Content-Type": "application/json"}
        denied = [
            (f"{rpc}/create_engine", evil, {}),
            (f"{rpc}/call", evil, {}),
            (f"{rpc}/set_env", json.dumps({"env": {"X": "1"}}).encode(), {}),
            (f"{rpc}/call", evil, wrong),
            (f"{srv}/set_version", js, {}),
            (f"{srv}/pause", b"{}", {}),
            (f"{srv}/abort_request", b"{}", wrong),
            (f"{srv}/update_weights_from_disk", json.dumps({"model_path": "/tmp"}).encode(), {}),
            (f"{srv}/init_weights_update_group", b"{}", {}),
            (f"{srv}/commit_weights", b"{}", {}),
            (f"{prx}/rl/start_session", json.dumps({"task_id": "x"}).encode(), {}),
            (f"{prx}/export_trajectories", json.dumps({"session_id": "s"}).encode(), wrong),
            (f"{prx}/grant_capacity", b"{}", {}),
        ]
        answers = _from_node(c, "b", denied, env_b)
        assert [s for s, _ in answers] == [401] * len(denied), list(zip(denied, answers))
        after = _from_node(
            c, "b", [(f"{srv}/version", None, {}), (f"{srv}/is_paused", None, {})], env_b
        )
        assert [json.loads(body) for _, body in after] == [{"version": 0}, {"is_paused": False}]
        assert not marker.exists(), "the pickled payload was unpickled"
        assert all(p.poll() is None for p in procs)

        # The same node with the secret / admin key gets through: the 401 was the check.
        ok = _from_node(
            c, "b",
            [
                (f"{rpc}/call", b"not a pickle", {"Authorization": f"Bearer {secret}"}),
                (f"{srv}/pause", b"{}", {"Authorization": f"Bearer {secret}"}),
                (f"{srv}/is_paused", None, {}),
                (f"{srv}/continue", b"{}", {"Authorization": f"Bearer {secret}"}),
                (f"{prx}/rl/start_session", json.dumps({"task_id": "x"}).encode(),
                 {"Authorization": "Bearer cross-node-admin", "Content-Type": "application/json"}),
            ],
            env_b,
        )  # fmt: skip
        assert [s for s, _ in ok] == [400, 200, 200, 200, 200], ok
        assert json.loads(ok[2][1]) == {"is_paused": True}

        # Every listening socket of node A is on A's address (none on 0.0.0.0 / ::).
        listening = _listening(c, "a")
        for port in (RPC_PORT, SERVER_PORT, PROXY_PORT):
            assert (a, port) in listening, listening
        assert {addr for addr, _ in listening} <= {a, "127.0.0.1"}, listening
        rejected = open(tmp_path / "rpc.log").read()
        assert "401" in rejected or "reject" in rejected.lower(), rejected[-2000:]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()


def test_cluster_gethostip_on_node_without_default_route_is_node_address(netns_cluster):
    """A node whose only route is the cluster subnet publishes that address, not 127.0.0.1."""
    c = netns_cluster
    code = "from areal.utils.network import gethostip; print(gethostip())"
    for name, node in c.nodes.items():
        r = c.run(name, [sys.executable, "-c", code])
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == node.addr
