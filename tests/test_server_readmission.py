"""``ServerWatchdog`` readmits a given-up server whose node came back (one host, cheap).

A server that went silent (a cut link) is given up and replaced; its old address is then
probed every ``probe_interval`` s for ``readmit_window`` s. When it answers again (the
node returned, the process lived) it is readmitted beside its replacement, with the
current weights loaded before it is marked healthy. Real HTTP health endpoints on
127.0.0.1 (one is stopped and started again on the same port: the "link" going down and
up); the scheduler, the engine's rotation and the weight sync are small fakes that record
what the watchdog asked; the clock is a fake one.
"""

from __future__ import annotations

import http.server
import threading
import types

import pytest

from areal.infra.weights.server_watchdog import ServerWatchdog


class _Health:
    """``GET /health`` -> 200 on 127.0.0.1; ``down()`` / ``up()`` close and reopen the port."""

    def __init__(self, port: int = 0):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def log_message(self, *a):
                pass

        self._handler = H
        self.port = port
        self.up()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def up(self) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def down(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Rotation:
    """The engine's rotation (``RemoteInfEngine``'s API the watchdog uses)."""

    def __init__(self, addrs: list[str]):
        self.addresses = list(addrs)
        self.healthy: set[str] = set(addrs)
        self.hung: set[str] = set()
        self.loaded: dict[str, int] = {}  # address -> weights version it was given
        self.config = types.SimpleNamespace(health_check_timeout=1.0)

    @property
    def healthy_addresses(self) -> list[str]:
        return [a for a in self.addresses if a in self.healthy]

    @property
    def hung_addresses(self) -> list[str]:
        return [a for a in self.addresses if a in self.hung]

    def exclude_server(self, addr: str, why: str = "") -> None:
        self.healthy.discard(addr)

    def readmit_server(self, addr, weights_path=None, version=None, replaces=None):
        assert addr not in self.healthy  # no requests before it holds the weights
        self.loaded[addr] = version
        if replaces is not None and replaces in self.addresses:
            self.addresses[self.addresses.index(replaces)] = addr
        elif addr not in self.addresses:
            self.addresses.append(addr)
        self.hung.discard(addr)
        self.healthy.add(addr)


class _WeightSync:
    """``WeightSynchronizer.readmit``: the current version (disk mode, no actor needed)."""

    def __init__(self, rollout: _Rotation, version: int):
        self.rollout = rollout
        self.version = version
        self.calls: list[tuple[str, str | None]] = []

    def readmit(self, address, replaces=None, allow_actor=True):
        self.calls.append((address, replaces))
        path = f"/ckpt/v{self.version}"
        self.rollout.readmit_server(address, path, self.version, replaces=replaces)
        return path, self.version


class _Scheduler:
    """Two servers; ``restart_worker`` brings up ``replacement`` (or the same address)."""

    def __init__(self, addrs: list[str], replacement: str):
        self.addrs = list(addrs)
        self.replacement = replacement
        self.lost: set[str] = set()
        self.killed: list[str] = []

    def get_workers(self, role):
        return [
            types.SimpleNamespace(id=f"{role}/{i}", address=a) for i, a in enumerate(self.addrs)
        ]

    def dead_workers(self, role):
        return sorted(self.lost)

    def kill_worker(self, wid):
        self.killed.append(wid)
        self.lost.add(wid)

    def restart_worker(self, wid):
        self.lost.discard(wid)
        self.addrs[int(wid.rpartition("/")[2])] = self.replacement
        return types.SimpleNamespace(id=wid, address=self.replacement)


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def servers():
    made = [_Health() for _ in range(3)]
    yield made
    for s in made:
        try:
            s.down()
        except Exception:  # noqa: BLE001 - already down
            pass


def _watchdog(servers, replacement: str, window: float = 600.0):
    s0, s1 = servers[0].address, servers[1].address
    rot = _Rotation([s0, s1])
    ws = _WeightSync(rot, version=3)
    sched = _Scheduler([s0, s1], replacement)
    clock = _Clock()
    dog = ServerWatchdog(
        sched, rot, weight_sync=ws, background=False, readmit_window=window,
        probe_interval=0.0, clock=clock,
    )  # fmt: skip
    return dog, rot, ws, sched, clock


def test_given_up_server_answers_again_readmitted_beside_replacement_with_current_weights(
    servers, caplog
):
    s0, s1, s2 = (s.address for s in servers)
    dog, rot, ws, sched, clock = _watchdog(servers, replacement=s2)
    servers[1].down()  # node B's link is cut: its server is silent
    rot.healthy.discard(s1)
    rot.hung.add(s1)  # the health loop declared it hung

    assert dog.check() == 1  # given up, replaced by s2 (background=False: in check())
    assert sched.killed == ["rollout/1"]
    assert rot.healthy_addresses == [s0, s2]
    assert ws.calls == [(s2, s1)]
    clock.t += 5
    assert dog.check() == 0  # s1 probed: still silent
    assert dog.returned == {}

    servers[1].up()  # the link is back; the process lived and answers on its address
    clock.t += 5
    with caplog.at_level("WARNING"):
        assert dog.check() == 1
    assert ws.calls[-1] == (s1, None)  # readmitted beside its replacement, not instead
    assert rot.loaded[s1] == 3  # with the current weights, before it was marked healthy
    assert rot.healthy_addresses == [s0, s2, s1]
    assert dog.returned == {s1: "rollout/1"}
    assert f"rollout/1's old process at {s1} answers again 10.0 s after" in caplog.text
    assert f"its replacement {s2} stays" in caplog.text
    stats = dog.step_stats()
    assert stats["rollout/server_readmits_total"] == 1.0
    assert stats["rollout/server_restarts_total"] == 1.0
    assert stats["rollout/servers_healthy"] == 3.0
    assert dog.check() == 0  # nothing more to do
    assert len(ws.calls) == 2

    # out of rotation again (a second cut): probed again, readmitted again once it answers
    rot.healthy.discard(s1)
    assert dog.check() == 1  # it still answers: readmitted at once
    assert ws.calls[-1] == (s1, None)
    assert dog.step_stats()["rollout/server_readmits_total"] == 2.0


def test_given_up_server_silent_past_readmit_window_forgotten(servers):
    s0, s1, s2 = (s.address for s in servers)
    dog, rot, ws, sched, clock = _watchdog(servers, replacement=s2, window=30.0)
    servers[1].down()
    rot.healthy.discard(s1)
    rot.hung.add(s1)
    assert dog.check() == 1
    clock.t += 31  # past readmit_window: no longer probed
    servers[1].up()
    assert dog.check() == 0
    assert dog.returned == {}
    assert ws.calls == [(s2, s1)]
    assert rot.healthy_addresses == [s0, s2]


def test_restart_on_the_same_address_is_not_readmitted_twice(servers):
    s0, s1, _ = (s.address for s in servers)
    dog, rot, ws, sched, clock = _watchdog(servers, replacement=s1)  # same host:port
    rot.healthy.discard(s1)
    rot.hung.add(s1)
    assert dog.check() == 1
    clock.t += 5
    assert dog.check() == 0  # s1 answers, but it is the replacement: nothing to readmit
    assert ws.calls == [(s1, s1)]
    assert dog.returned == {}


def test_server_whose_restart_fails_readmitted_when_its_node_returns(servers, caplog):
    """No node has room for a replacement: the old server is readmitted on its own node
    once it answers again, with the current weights."""
    s0, s1, s2 = (s.address for s in servers)
    dog, rot, ws, sched, clock = _watchdog(servers, replacement=s2)
    dog.max_restarts = 1

    def no_room(wid):
        raise RuntimeError("no node with room")

    sched.restart_worker = no_room
    servers[1].down()
    rot.healthy.discard(s1)
    rot.hung.add(s1)
    with caplog.at_level("WARNING"):
        assert dog.check() == 0  # the restart failed: given up (max_restarts=1)
    assert "giving up on it" in caplog.text
    servers[1].up()
    clock.t += 5
    assert dog.check() == 1
    assert ws.calls == [(s1, None)]
    assert rot.loaded[s1] == 3
    assert rot.healthy_addresses == [s0, s1]
    assert dog.returned == {s1: "rollout/1"}
