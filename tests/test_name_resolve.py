"""name_resolve backends: the file backend and etcd3 (a real etcd server) behave alike.

The etcd3 cases run against Debian's ``etcd-server`` started by a fixture on 127.0.0.1;
the cross-node case starts it inside a network namespace (tests/netns_cluster.py).
"""

from __future__ import annotations

import functools
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from netns_cluster import etcd_skip_reason, start_etcd, stop_process

from areal.api.cli_args import NameResolveConfig
from areal.utils.name_resolve import (
    Etcd3NameRecordRepository,
    FileNameRecordRepository,
    NameEntryExistsError,
    NameEntryNotFoundError,
    make_repository,
)

needs_etcd = pytest.mark.skipif(etcd_skip_reason() is not None, reason=str(etcd_skip_reason()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd_addr(tmp_path_factory):
    reason = etcd_skip_reason()
    if reason:
        pytest.skip(reason)
    port = _free_port()
    proc = start_etcd(str(tmp_path_factory.mktemp("etcd")), "127.0.0.1", port, _free_port())
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture(params=["nfs", "etcd3"])
def repo(request, tmp_path):
    if request.param == "nfs":
        yield FileNameRecordRepository(str(tmp_path / "nr"))
        return
    addr = request.getfixturevalue("etcd_addr")
    r = make_repository(NameResolveConfig(type="etcd3", etcd3_addr=addr))
    assert isinstance(r, Etcd3NameRecordRepository)
    r.clear_subtree("e")  # the server is shared by the module's tests
    try:
        yield r
    finally:
        r.close()


def test_name_resolve_add_replace_get_delete(repo):
    repo.add("e/t/workers/actor/0", "127.0.0.1:1")
    with pytest.raises(NameEntryExistsError):
        repo.add("e/t/workers/actor/0", "x")
    assert repo.get("e/t/workers/actor/0") == "127.0.0.1:1"
    repo.add("e/t/workers/actor/0", "127.0.0.1:2", replace=True)
    assert repo.get("/e/t/workers/actor/0/") == "127.0.0.1:2"  # slashes stripped
    repo.delete("e/t/workers/actor/0")
    with pytest.raises(NameEntryNotFoundError):
        repo.get("e/t/workers/actor/0")
    with pytest.raises(NameEntryNotFoundError):
        repo.delete("e/t/workers/actor/0")
    for bad in ("../escape", "e//t", "", "e/./t"):
        with pytest.raises(ValueError):
            repo.add(bad, "x")


def test_name_resolve_subtree_sorted_excludes_siblings_with_same_prefix(repo):
    repo.add("e/t/workers/actor/1", "b")
    repo.add("e/t/workers/actor/0", "a")
    repo.add("e/t/workers/actor", "root")  # the root key itself belongs to its subtree
    repo.add("e/t/workers/actor-x/0", "sibling")  # same string prefix, other subtree
    repo.add("e/t/workers/actors/0", "sibling2")
    assert repo.find_subtree("e/t/workers/actor") == [
        "e/t/workers/actor",
        "e/t/workers/actor/0",
        "e/t/workers/actor/1",
    ]
    assert repo.get_subtree("e/t/workers/actor") == ["root", "a", "b"]
    assert repo.find_subtree("e/t/none") == []
    repo.clear_subtree("e/t/workers/actor")
    assert repo.find_subtree("e/t/workers/actor") == []
    assert repo.get("e/t/workers/actor-x/0") == "sibling"
    assert repo.get("e/t/workers/actors/0") == "sibling2"


def test_name_resolve_wait_returns_when_key_appears_and_times_out_naming_key(repo):
    with pytest.raises(TimeoutError, match="e/t/missing"):
        repo.wait("e/t/missing", timeout=0.2)
    timer = threading.Timer(0.3, repo.add, args=("e/t/late", "v"))
    timer.start()
    try:
        # the value, not the TimeoutError of the 10 s timeout: it returned when the key came
        assert repo.wait("e/t/late", timeout=10, poll_frequency=0.05) == "v"
    finally:
        timer.cancel()


def test_name_resolve_concurrent_add_exactly_one_winner(repo):
    wins, losses = [], []

    def racer(i):
        try:
            repo.add("e/t/leader", f"r{i}")
            wins.append(i)
        except NameEntryExistsError:
            losses.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(wins) == 1 and len(losses) == 7
    assert repo.get("e/t/leader") == f"r{wins[0]}"


# A process that registers a key bound to a lease, then sleeps until killed.
OWNER = """
import sys, time
from areal.utils.name_resolve import Etcd3NameRecordRepository
repo = Etcd3NameRecordRepository(sys.argv[1])
repo.add(sys.argv[2], "owner-alive", keepalive_ttl=float(sys.argv[3]))
print("added", flush=True)
time.sleep(600)
"""


def _start_owner(addr, key, ttl, popen=subprocess.Popen):
    proc = popen(
        [sys.executable, "-c", OWNER, addr, key, str(ttl)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "added"
    return proc


def _wait_gone(repo, key, within: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            repo.get(key)
        except NameEntryNotFoundError:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"{key} still there after {within} s"
        time.sleep(0.1)


@needs_etcd
def test_etcd3_lease_key_lives_with_its_owner_and_expires_when_it_dies(etcd_addr):
    repo = Etcd3NameRecordRepository(etcd_addr)
    ttl = 2
    owner = _start_owner(etcd_addr, "e/lease/owner", ttl)
    try:
        time.sleep(ttl * 2)  # twice the TTL: the owner's keepalive holds the key
        assert repo.get("e/lease/owner") == "owner-alive"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        # expires with its lease (a generous bound: a key that outlived its owner's lease
        # would stay forever)
        assert _wait_gone(repo, "e/lease/owner", within=ttl * 15) <= ttl * 15
    finally:
        stop_process(owner)
    # A clean close deletes what the repository added (delete_on_exit), leases revoked.
    mine = Etcd3NameRecordRepository(etcd_addr)
    mine.add("e/lease/mine", "x", keepalive_ttl=30)
    mine.add("e/lease/kept", "y", delete_on_exit=False)
    mine.close()
    with pytest.raises(NameEntryNotFoundError):
        repo.get("e/lease/mine")
    assert repo.get("e/lease/kept") == "y"
    repo.delete("e/lease/kept")


def test_etcd3_unreachable_server_raises_naming_address_no_hang():
    port = _free_port()  # nothing listens there
    repo = Etcd3NameRecordRepository(f"127.0.0.1:{port}", timeout=2)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        repo.get("e/x")
    assert time.monotonic() - t0 < 20  # no hang: a generous bound, 10x its 2 s timeout
    with pytest.raises(ValueError, match="etcd3_addr"):
        Etcd3NameRecordRepository("no-port")


@needs_etcd
def test_etcd3_across_nodes_owner_on_b_lost_with_its_node(netns_cluster, tmp_path):
    """etcd on node A; a process on node B registers its key; node B dies: the key goes."""
    c = netns_cluster
    a = c["a"]
    etcd = start_etcd(str(tmp_path), a.addr, 2379, 2380, popen=functools.partial(c.popen, "a"))
    try:
        addr = f"{a.addr}:2379"
        owner = _start_owner(addr, "e/nodes/b", 2, popen=functools.partial(c.popen, "b"))
        repo = Etcd3NameRecordRepository(addr)  # the root namespace, through the bridge
        assert repo.get("e/nodes/b") == "owner-alive"
        # etcd listens on A's address only: from node B, 127.0.0.1:2379 is B's own loopback.
        probe = "import socket; socket.create_connection(('127.0.0.1', 2379), timeout=2)"
        assert c.run("b", [sys.executable, "-c", probe]).returncode != 0
        c.kill_node("b")
        owner.wait(timeout=10)
        _wait_gone(repo, "e/nodes/b", within=8)
    finally:
        stop_process(etcd)


@pytest.mark.slow
@needs_etcd
def test_local_scheduler_etcd3_config_publishes_workers_in_etcd(etcd_addr, tmp_path):
    """``cluster.name_resolve.type=etcd3``: the scheduler's addresses land in the etcd server."""
    from areal.api.cli_args import BaseExperimentConfig, ClusterSpecConfig
    from areal.api.scheduler_api import Job, SchedulingSpec
    from areal.infra.scheduler import LocalScheduler

    nr = NameResolveConfig(type="etcd3", etcd3_addr=etcd_addr)
    cfg = BaseExperimentConfig(
        experiment_name="e",
        trial_name="etcd",
        cluster=ClusterSpecConfig(fileroot=str(tmp_path), name_resolve=nr),
    )
    sched = LocalScheduler(exp_config=cfg, fileroot=str(tmp_path))
    try:
        assert isinstance(sched.name_resolve, Etcd3NameRecordRepository)
        # a command worker (a plain HTTP server) starts in well under a second
        cmd = f"{sys.executable} -m http.server {{port}} --bind {{host}} --directory {tmp_path}"
        spec = SchedulingSpec(cpu=1, mem=1, cmd=cmd)
        sched.create_workers(Job(replicas=1, tasks=[spec], role="w", health_path="/"))
        (w,) = sched.get_workers("w")
        reader = Etcd3NameRecordRepository(etcd_addr)
        assert reader.get("e/etcd/workers/w/0") == w.address
    finally:
        sched.delete_workers(None)
        sched.close()
    assert not (tmp_path / "name_resolve").exists()
