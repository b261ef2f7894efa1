"""RPC worker: endpoints in-process (aiohttp test server), serialization, parent watchdog."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import requests
import torch
from aiohttp.test_utils import TestClient, TestServer

from areal.api.scheduler_api import RemoteCallError
from areal.infra.rpc import rpc_server
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.rpc_server import EngineHost, build_app, import_from_path
from areal.infra.rpc.serialization import CONTENT_TYPE, deserialize, serialize
from areal.utils.auth import RUN_SECRET_ENV

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
    async with TestClient(TestServer(build_app(host, None))) as client:
        resp = await client.get("/health")
        assert resp.status == 200 and (await resp.json())["engines"] == []
        status, out = await _post(client, "/call", {"method": "add", "args": (1, 2)})
        assert status == 404 and "No engine named 'default'" in out["error"]
        assert out["error_type"] == "KeyError" and out["client_error"] is True
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
    async with TestClient(TestServer(build_app(host, None))) as client:
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


def _worker_env(secret: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != RUN_SECRET_ENV}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    if secret is not None:
        env[RUN_SECRET_ENV] = secret
    return env


class _MakeFile:
    """Unpickling this object creates ``path`` (what an attacker would send)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def secured_worker(tmp_path_factory):
    """A real RPC worker process started with a run secret; yields (address, secret, log)."""
    secret = "test-secret-" + str(os.getpid())
    port = _free_port()
    log = tmp_path_factory.mktemp("rpcw") / "worker.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal.infra.rpc.rpc_server", "--port", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_worker_env(secret),
        )
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                RPCClient(addr, secret=secret).health(timeout=2)
                break
            except requests.RequestException:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield addr, secret, log
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("key", [None, "wrong-secret"])
def test_rpc_worker_unauthenticated_pickle_payload_is_not_unpickled_401(
    secured_worker, tmp_path, key
):
    addr, _, log = secured_worker
    target = tmp_path / "pwned"
    body = serialize({"method": "x", "args": (_MakeFile(str(target)),)})
    assert not target.exists()
    headers = {"Content-Type": CONTENT_TYPE}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    for path in ("/call", "/create_engine"):
        r = requests.post(f"http://{addr}{path}", data=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert "unauthorized" in r.json()["error"]["message"]
    r = requests.post(f"http://{addr}/set_env", json={"env": {"X": "1"}}, timeout=30)
    assert r.status_code == 401
    time.sleep(0.5)  # nothing runs later either
    assert not target.exists()
    text = log.read_text()
    assert "RPC worker 401 POST /call" in text and ("missing" if key is None else "wrong") in text
    assert (key or "test-secret") not in text  # keys are never logged


def test_rpc_worker_with_secret_executes_payload_and_client_sends_it(secured_worker, tmp_path):
    addr, secret, _ = secured_worker
    target = tmp_path / "made"
    client = RPCClient(addr, secret=secret)
    client.create_engine(ECHO, engine_name="e")
    assert client.call("add", 1, 2, engine_name="e") == 3.0
    # the same kind of payload as above is executed once authenticated: the 401 was the guard
    body = serialize({"method": "x", "args": (_MakeFile(str(target)),)})
    headers = {"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {secret}"}
    requests.post(f"http://{addr}/call", data=body, headers=headers, timeout=30)
    assert target.exists()


def test_rpc_worker_without_secret_refuses_to_start():
    proc = subprocess.run(
        [sys.executable, "-m", "areal.infra.rpc.rpc_server", "--port", str(_free_port())],
        env=_worker_env(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == rpc_server.EXIT_NO_SECRET
    assert "AREAL_RUN_SECRET is not set" in proc.stderr + proc.stdout


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
        stderr=subprocess.PIPE,
        text=True,
        env=_worker_env("s"),
    )
    try:
        # its own exit code, not 1 (which any uncaught exception gives), before serving
        code = server.wait(timeout=30)
        err = server.stderr.read()
        assert code == rpc_server.EXIT_PARENT_GONE, err
        assert f"Parent process {parent.pid} is gone" in err
        assert "serving on" not in err
    finally:
        for p in (server, parent):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    assert (
        not psutil.pid_exists(server.pid)
        or psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE
    )


def test_rpc_worker_fuzzed_bodies_never_5xx_never_die(secured_worker):
    """Property: whatever an authenticated client sends (random bytes, pickles of the wrong
    shape, bad JSON), the worker answers 4xx with an error and stays alive."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    addr, secret, _ = secured_worker
    auth = {"Authorization": f"Bearer {secret}"}
    payloads = st.one_of(
        st.binary(max_size=512),
        st.builds(
            serialize, st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers()))
        ),
        st.builds(
            serialize,
            st.dictionaries(st.sampled_from(["args", "kwargs", "engine_name", "x"]), st.integers()),
        ),
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/call", "/create_engine", "/set_env"]), body=payloads)
    def check(path, body):
        ct = "application/json" if path == "/set_env" else CONTENT_TYPE
        r = requests.post(
            f"http://{addr}{path}", data=body, headers={"Content-Type": ct, **auth}, timeout=30
        )
        assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:300])

    check()
    assert requests.get(f"http://{addr}/health", timeout=10).status_code == 200


def test_rpc_worker_fuzzed_call_shapes_client_errors_are_4xx_valid_calls_200(secured_worker):
    """Property over well-formed pickles of the wrong shape: wrong types or missing fields,
    unknown engines/methods/classes, arguments that do not fit, invalid environment
    variables. A client error is 400/404 (named in the payload, nothing executed), a valid
    call 200; never a 5xx, and the worker stays alive."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    addr, secret, _ = secured_worker
    client = RPCClient(addr, secret=secret)
    client.create_engine(ECHO, engine_name="fz")
    headers = {"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {secret}"}
    values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    )
    # methods that never raise when called correctly, so any 5xx is a server bug
    names = st.one_of(st.sampled_from(["pid", "num_threads", "scale", "nope", ""]), values)
    engines = st.one_of(st.sampled_from(["fz", "default", "missing"]), values)
    classes = st.one_of(
        st.sampled_from([ECHO, "tests._rpc_engines.Nope", "no_such_pkg_xyz.Mod", "x", ""]),
        values,
    )
    fields = {
        "method": names,
        "engine": classes,
        "engine_name": engines,
        "args": st.one_of(st.lists(values, max_size=3), st.tuples(values), values),
        "kwargs": st.one_of(st.dictionaries(st.text(max_size=8), values, max_size=3), values),
    }
    payloads = st.fixed_dictionaries({}, optional=fields)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/call", "/create_engine"]), payload=payloads)
    def check(path, payload):
        if payload.get("engine") == ECHO and path == "/create_engine":
            payload["engine_name"] = "fz2"  # keep "fz" as created above
        r = requests.post(
            f"http://{addr}{path}", data=serialize(payload), headers=headers, timeout=30
        )
        assert r.status_code < 500, (path, payload, r.status_code, r.content[:300])
        out = deserialize(r.content)
        if r.status_code == 200:
            assert out["ok"] is True
        else:
            assert r.status_code in (400, 404) and out["ok"] is False
            assert out["client_error"] is True and out["error_type"] and out["error"]

    check()
    for env in ({"A=B": "1"}, {"": "x"}, {"K": "a\x00b"}, {"\x00": "1"}):
        r = requests.post(
            f"http://{addr}/set_env",
            json={"env": env},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=30,
        )
        assert r.status_code == 400, (env, r.status_code, r.text)
    # the worker is alive and the engine still answers correctly
    assert client.call("scale", engine_name="fz") == 1.0
    assert client.call("pid", engine_name="fz") > 0
    with pytest.raises(RemoteCallError, match="raised KeyError: No engine named 'nope'"):
        client.call("pid", engine_name="nope")
    with pytest.raises(RemoteCallError, match=r"raised TypeError: pid: arguments do not fit"):
        client.call("pid", 1, engine_name="fz")
