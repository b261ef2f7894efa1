"""RPC worker: endpoints in-process (aiohttp test server), serialization, parent watchdog."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from areal.infra.rpc.rpc_server import EngineHost, build_app, import_from_path
from areal.infra.rpc.serialization import CONTENT_TYPE, deserialize, serialize

# In-process: pytest puts tests/ on sys.path (rootdir-relative imports).
ECHO = "_rpc_engines.EchoEngine"


def test_serialize_nested_tensors_roundtrip_equal():
    obj = {"a": torch.randn(3, 4), "b": [torch.arange(5), {"c": 1.5}], "d": None}
    out = deserialize(serialize(obj))
    assert torch.equal(out["a"], obj["a"]) and torch.equal(out["b"][0], obj["b"][0])
    assert out["b"][1] == {"c": 1.5} and out["d"] is None


def test_import_from_path_class_and_bad_path():
    assert import_from_path("areal.infra.rpc.rpc_server.EngineHost") is EngineHost
    assert import_from_path("areal.infra.rpc.rpc_server:EngineHost") is EngineHost
    with pytest.raises(ValueError, match="Not an import path"):
        import_from_path("NoDots")


async def _post(client: TestClient, path: str, payload: dict):
    resp = await client.post(path, data=serialize(payload), headers={"Content-Type": CONTENT_TYPE})
    return resp.status, deserialize(await resp.read())


async def test_rpc_app_create_call_attribute_and_errors():
    host = EngineHost()
    async with TestClient(TestServer(build_app(host))) as client:
        resp = await client.get("/health")
        assert resp.status == 200 and (await resp.json())["engines"] == []
        status, out = await _post(client, "/call", {"method": "add", "args": (1, 2)})
        assert status == 500 and "No engine named 'default'" in out["error"]
        status, out = await _post(
            client, "/create_engine", {"engine": ECHO, "kwargs": {"scale": 3.0}}
        )
        assert status == 200 and out == {"ok": True}
        status, out = await _post(
            client, "/call", {"method": "add", "args": (torch.ones(2), torch.ones(2))}
        )
        assert status == 200 and torch.equal(out["result"], torch.full((2,), 6.0))
        status, out = await _post(client, "/call", {"method": "scale"})  # plain attribute
        assert status == 200 and out["result"] == 3.0
        status, out = await _post(client, "/call", {"method": "fail", "args": ("xyz",)})
        assert status == 500 and out["error_type"] == "ValueError" and "xyz" in out["error"]
        assert "_rpc_engines.py" in out["traceback"]
        resp = await client.post("/set_env", json={"env": {"AREAL_TEST_RPC_ENV": "v1"}})
        assert resp.status == 200
        status, out = await _post(
            client, "/call", {"method": "env", "args": ("AREAL_TEST_RPC_ENV",)}
        )
        assert out["result"] == "v1"


async def test_rpc_app_calls_run_on_one_thread_in_order():
    host = EngineHost()
    names = []
    orig = host.run

    def spy(kind, body):
        names.append(threading.current_thread().name)
        return orig(kind, body)

    host.run = spy
    async with TestClient(TestServer(build_app(host))) as client:
        await _post(client, "/create_engine", {"engine": ECHO})
        import asyncio

        t0 = time.monotonic()
        outs = await asyncio.gather(
            *[_post(client, "/call", {"method": "sleep", "args": (0.3,)}) for _ in range(3)]
        )
        assert time.monotonic() - t0 >= 0.85  # serialized, not concurrent
        assert all(s == 200 for s, _ in outs)
        resp = await client.get("/health")  # health answers while idle again
        assert resp.status == 200
    assert len(set(names)) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_server_exits_when_parent_pid_gone():
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    port = _free_port()
    # --parent-pid names a process that is not our real parent: the watchdog sees a
    # mismatch at once, like a worker re-parented after its controller died.
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.infra.rpc.rpc_server",
            "--port",
            str(port),
            "--parent-pid",
            str(parent.pid),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert server.wait(timeout=30) == 1
    finally:
        for p in (server, parent):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    assert (
        not psutil.pid_exists(server.pid)
        or psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE
    )
