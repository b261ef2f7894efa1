"""Weight fingerprints (areal.infra.weights.fingerprint) and the verifying sync hook
(areal.infra.weight_verify) against a real built-in server app on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import types

import pytest
import torch

from areal.infra.weight_sync import WeightSyncContext
from areal.infra.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch
from areal.infra.weights.fingerprint import (
    FULL_SAMPLE_MAX,
    LiveFingerprints,
    Packed,
    WeightDigests,
    _sample_slice,
    compare_fingerprints,
    fingerprint_named,
    fingerprint_tensor,
    read_reference,
    rotation_share,
    write_reference,
    write_request,
)
from areal.utils.auth import auth_headers, get_run_secret


def test_fingerprint_same_weights_match_any_layout_and_dtype_exactly():
    torch.manual_seed(0)
    w = torch.randn(300, 70) * 0.02  # not a multiple of the row length
    ref = {"w": fingerprint_tensor("w", w)}
    assert compare_fingerprints(ref, {"w": fingerprint_tensor("w", w.t().contiguous().t())}) == []
    assert compare_fingerprints(ref, {"w": fingerprint_tensor("w", w.double())}) == []
    b = w.to(torch.bfloat16)  # a bf16 server: both sides fingerprint the bf16 values
    assert (
        compare_fingerprints(
            fingerprint_named({"w": w}, dtypes={"w": "bfloat16"}), {"w": fingerprint_tensor("w", b)}
        )
        == []
    )


def test_fingerprint_one_optimizer_step_or_one_element_or_a_swap_is_caught():
    torch.manual_seed(0)
    w = torch.randn(2048, 512) * 0.02
    ref = fingerprint_named({"a": w, "b": w.clone()})
    step = w - 1e-6 * torch.sign(torch.randn_like(w))  # one Adam step at lr 1e-6
    one = w.clone()
    one[1000, 3] += 1e-4
    for name, got in (("a", step), ("a", one), ("b", torch.zeros_like(w))):
        bad = compare_fingerprints(ref, fingerprint_named({"a": w, "b": w} | {name: got}))
        assert len(bad) == 1 and bad[0].startswith(name), bad
    # tensors under each other's name (a mixed-up export) and a missing tensor
    assert (
        len(
            compare_fingerprints(
                {"x": fingerprint_tensor("x", w)}, {"x": fingerprint_tensor("y", w)}
            )
        )
        == 1
    )
    assert compare_fingerprints(ref, {"a": ref["a"]}) == ["b (missing on the server)"]


def test_fingerprint_single_element_change_caught_anywhere():
    """One element off by 1e-3 (5e-5 of the tensor's norm) at 40 random places of a big
    tensor, and by 1e-5 in a norm-like vector of ones (sampled whole): always caught."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 512, generator=g) * 0.02
    ref = fingerprint_named({"w": w}, seed=5)
    for i in torch.randint(0, w.numel(), (40,), generator=g).tolist():
        one = w.clone()
        one.view(-1)[i] += 1e-3
        assert compare_fingerprints(ref, fingerprint_named({"w": one}, seed=5)) != [], i
    ln = torch.ones(3000)
    ref = fingerprint_named({"ln": ln}, seed=5)
    for i in (0, 1499, 2999):
        one = ln.clone()
        one[i] += 1e-5
        bad = compare_fingerprints(ref, fingerprint_named({"ln": one}, seed=5))
        assert len(bad) == 1 and "sampled elements differ" in bad[0]


def test_fingerprint_export_digests_equal_live_and_rotation_covers_every_tensor_once():
    """Digests taken during the export (``WeightDigests``, a rotation share in full, the
    rest sampled) give the fingerprints of the live tensors; over ``every`` checks the
    shares are disjoint, cover every tensor too big to be sampled whole, and are balanced."""
    torch.manual_seed(0)
    shapes = {"emb": (400, 64), "a": (300, 70), "b": (5000, 64), "c": (128, 64), "n": (64,)}
    named = {n: torch.randn(*s) * 0.02 for n, s in shapes.items()}
    sizes = [(n, t.numel()) for n, t in named.items()]
    every = 3
    shares = [rotation_share(sizes, every, i) for i in range(every)]
    big = {n for n, k in sizes if k > FULL_SAMPLE_MAX}
    assert set().union(*shares) == big and sum(len(x) for x in shares) == len(big)
    assert rotation_share(sizes, every, every + 1) == shares[1]  # it cycles
    assert rotation_share(sizes, 1, 5) == big  # every=1: all in full
    for share in shares:
        exported = WeightDigests(full=share)
        items = list(named.items())
        exported.add(items[:2])  # bucket by bucket
        exported.add(items[2:])
        fps = exported.fingerprints(9)
        assert fps == fingerprint_named(named, seed=9, full=share)
        assert {n for n, fp in fps.items() if len(fp) > 2} == share  # full: k + 3 numbers
        assert all(len(fp) == 2 for n, fp in fps.items() if n not in share)  # sample
    assert WeightDigests(enabled=False).fingerprints(9) == {}  # ranks that do not answer


def test_fingerprint_live_views_equal_named_and_follow_in_place_updates():
    """``LiveFingerprints`` (the server's cached sample views) gives exactly the numbers
    of ``fingerprint_named`` and sees in-place updates (how every loader writes); tensors
    NumPy cannot view (bfloat16) go through ``fingerprint_named``."""
    torch.manual_seed(0)
    named = {
        "a": torch.randn(300, 70),
        "h": torch.randn(5000).half(),
        "n": torch.ones(64),
        "e": torch.zeros(0),
    }
    live = LiveFingerprints(named)
    for full in (None, {"a"}, set()):
        assert live.fingerprints(3, full=full) == fingerprint_named(named, 3, full=full)
    before = live.fingerprints(4)
    with torch.no_grad():
        named["a"][7, 3] += 1e-3  # in place, as the loaders do
    after = live.fingerprints(4)
    assert after == fingerprint_named(named, 4)
    assert compare_fingerprints(before, after) != [] and after["n"] == before["n"]
    bf = {"b": torch.randn(300, 70).bfloat16()}
    assert LiveFingerprints(bf).fingerprints(2) == fingerprint_named(bf, 2)


def test_fingerprint_sample_only_catches_a_step_but_not_an_unsampled_element():
    """Sample only (a tensor outside this check's rotation share): a tensor left at its
    previous version (one optimizer step ago) or zeroed is caught; one element off outside
    the sampled positions is not (that is what the rotating row sums are for)."""
    torch.manual_seed(0)
    w = torch.randn(2048, 512) * 0.02
    ref = fingerprint_named({"w": w}, seed=4, full=())
    step = w - 1e-6 * torch.sign(torch.randn_like(w))  # one Adam step at lr 1e-6
    for got in (step, torch.zeros_like(w)):
        bad = compare_fingerprints(ref, fingerprint_named({"w": got}, seed=4, full=()))
        assert len(bad) == 1 and "sampled elements differ" in bad[0]
    one = w.clone()
    one.view(-1)[_unsampled("w", w.numel())] += 1e-4
    assert compare_fingerprints(ref, fingerprint_named({"w": one}, seed=4, full=())) == []
    # a server answering a sample-only reference with a full fingerprint is compared on
    # the sample; a full reference answered by a sample only is a mismatch
    assert compare_fingerprints(ref, fingerprint_named({"w": w}, seed=4)) == []
    bad = compare_fingerprints(fingerprint_named({"w": w}, seed=4), ref)
    assert len(bad) == 1 and "length 2" in bad[0]


def test_fingerprint_packed_round_trips_through_json_empty_share_included_malformed_raises():
    """``Packed`` (the numbers of the reference file and the update answers, base64
    float64) gives back exactly the fingerprints, also for a check whose share is empty
    (more groups than large tensors); anything else raises ``ValueError``."""
    import json

    torch.manual_seed(0)
    named = {"a": torch.randn(300, 70), "n": torch.ones(64), "b": torch.randn(5000)}
    for full in (None, {"a"}, set()):
        live = LiveFingerprints(named)
        packed = json.loads(json.dumps(live.packed(full).encode()))
        assert Packed.decode(packed).as_dict() == fingerprint_named(named, 1, full=full)
    good = LiveFingerprints(named).packed({"a"}).encode()
    for bad in (
        {},
        {**good, "sample": good["sample"][:-4]},  # a byte count that is not 16 per name
        {**good, "full": ["zz"]},  # a name in full that is not in names
        {**good, "names": [["a"], "n", "b"]},
        {**good, "rows": "not base64!"},
    ):
        with pytest.raises(ValueError):
            Packed.decode(bad).as_dict()


def _unsampled(name: str, n: int) -> int:
    """An element index of a tensor of ``n`` elements that its sample does not contain."""
    offset, stride, _ = _sample_slice(name, n)
    i = n // 2
    return i + 1 if (i - offset) % stride == 0 else i


@pytest.fixture
def server_app(tiny_model_dir):
    """A built-in server app (tiny model) and a function making its test client (inside
    the test's event loop: a real socket on 127.0.0.1)."""
    from aiohttp.test_utils import TestClient, TestServer

    from areal.inference.server.app import LocalInferenceServer

    torch.set_num_threads(1)
    srv = LocalInferenceServer.from_pretrained(tiny_model_dir)
    return srv, lambda: TestClient(TestServer(srv.build_app(), host="127.0.0.1"))


def _checkpoint(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


class _Actor:
    """The trainer side as ``FSDPEngine`` answers it: ``export`` digests the pushed weights
    (after ``enable_weight_fingerprints``: the rotation share in full, the next share after
    each answered check), ``weights_fingerprint`` answers from those digests."""

    def __init__(self, named):
        self.every = 0
        self.checks = 0
        self.asked = 0  # weights_fingerprint calls (requests to the trainer)
        self.root = None
        self.export(named)

    def enable_weight_fingerprints(
        self, full_every=1, dtypes=None, reference_root=None, deferred=False
    ):
        self.every = full_every
        self.root = reference_root
        self.dtypes = dtypes
        self.deferred = deferred

    def export(self, named, path=None):
        """Digest ``named``; with a reference root (and ``path`` below it), write the
        reference there as ``FSDPEngine._save_hf`` does (``deferred``: only the request;
        the digests when ``fingerprint_reference`` asks)."""
        self.named = named
        sizes = [(n, t.numel()) for n, t in named.items()]
        self.digests = WeightDigests(
            full=rotation_share(sizes, self.every, self.checks) if self.every else None,
            dtypes=getattr(self, "dtypes", None),
        )
        seed = int.from_bytes(os.urandom(7), "little")
        if self.root and path and getattr(self, "deferred", False):
            share = self.digests.full
            full = [
                n for n, t in named.items() if t.numel() > 4096 and (share is None or n in share)
            ]
            write_request(path, seed, sorted(full))
            self.held = threading.Thread(
                target=lambda: (
                    time.sleep(0.02),  # the server loads meanwhile
                    self.digests.add(named.items()),
                    write_reference(path, seed, self.digests, atomic=True),  # as FSDPEngine
                )
            )
            self.held.start()
            self.checks += 1
            return
        self.digests.add(named.items())
        if self.root and path:
            write_reference(path, seed, self.digests)
            self.checks += 1

    def weights_fingerprint(self, seed, dtypes=None, full=None):
        self.asked += 1
        if dtypes is None and full is None:
            self.checks += 1
            return self.digests.fingerprints(seed)
        return fingerprint_named(self.named, seed, dtypes, full=full)


def _ctx(actor, address, version=1):
    rollout = types.SimpleNamespace(healthy_addresses=[address])
    return WeightSyncContext(version, version - 1, None, "step", actor, rollout)


async def test_fingerprint_endpoint_needs_run_secret_and_matches_checkpoint(
    server_app, tiny_model_dir
):
    srv, make_client = server_app
    async with make_client() as client:
        assert (await client.post("/weights_fingerprint", json={"seed": 3})).status == 401
        r = await client.post(
            "/weights_fingerprint", json={"seed": -1}, headers=auth_headers(get_run_secret())
        )
        assert r.status == 400
        r = await client.post(
            "/weights_fingerprint", json={"seed": 3}, headers=auth_headers(get_run_secret())
        )
        assert r.status == 200
        body = await r.json()
        headers = auth_headers(get_run_secret())
        for bad in ("model.norm.weight", [1], {"a": 1}):
            r = await client.post(
                "/weights_fingerprint", json={"seed": 3, "full": bad}, headers=headers
            )
            assert r.status == 400, bad
        full = ["lm_head.weight"]
        r = await client.post(
            "/weights_fingerprint", json={"seed": 3, "full": full}, headers=headers
        )
        sampled = (await r.json())["fingerprints"]
    ref = fingerprint_named(_checkpoint(tiny_model_dir), 3)
    assert compare_fingerprints(ref, body["fingerprints"]) == []  # no "full": every tensor
    assert body["dtypes"]["model.embed_tokens.weight"] == "float32"
    assert {n for n, fp in sampled.items() if len(fp) > 2} == set(full)
    assert (
        compare_fingerprints(fingerprint_named(_checkpoint(tiny_model_dir), 3, full=full), sampled)
        == []
    )


_FAULTY = "model.layers.1.mlp.down_proj.weight"  # 8192 elements: sampled, not whole


def _fault(kind, real_load, model, path, **kw):
    """Load ``path`` into ``model`` the way a server with bug ``kind`` would: the tensor
    ``_FAULTY`` keeps its old value (``skipped``: the loader never copies it; ``reverted``:
    something restores it after the load), is off by 1e-4 in one element outside its
    sampled positions (``one_element``) or carries noise 10x smaller than one step
    between versions (``noise``)."""
    import safetensors.torch as st

    import areal.inference.server.weights as weights

    old = dict(model.named_parameters())[_FAULTY].detach().clone()
    real_load_file = st.load_file

    def load_file(f, *a, **k):
        sd = real_load_file(f, *a, **k)
        if _FAULTY in sd:
            if kind == "skipped":
                sd[_FAULTY] = old.clone()
            elif kind == "one_element":
                sd[_FAULTY] = sd[_FAULTY].clone()
                sd[_FAULTY].view(-1)[_unsampled(_FAULTY, sd[_FAULTY].numel())] += 1e-4
            elif kind == "noise":
                sd[_FAULTY] = sd[_FAULTY] + 1e-6 * torch.randn_like(sd[_FAULTY])
        return sd

    st.load_file = load_file
    try:
        n = real_load(model, path, **kw)
    finally:
        st.load_file = real_load_file
    assert weights.load_weights_from_disk is not real_load
    if kind == "reverted":  # where the load wrote: the model, or the staged copy
        dst = kw["into"][_FAULTY] if kw.get("into") is not None else None
        with torch.no_grad():
            (dst if dst is not None else dict(model.named_parameters())[_FAULTY]).copy_(old)
    return n


def _inject(monkeypatch, kind):
    import functools

    import areal.inference.server.weights as weights

    monkeypatch.setattr(
        weights,
        "load_weights_from_disk",
        functools.partial(_fault, kind, weights.load_weights_from_disk),
    )


async def _push(client, weights_dir, named):
    """Write ``named`` as a checkpoint and have the server load it (a disk weight update)."""
    from safetensors.torch import save_file

    save_file(named, str(weights_dir / "model.safetensors"))
    r = await client.post(
        "/update_weights_from_disk",
        json={"model_path": str(weights_dir)},
        headers=auth_headers(get_run_secret()),
    )
    assert r.status == 200, await r.text()


async def _sync_check(hook, actor, client, weights_dir, named, version):
    """One ``WeightSynchronizer.sync`` of ``named`` as ``version`` with the hook:
    ``before_push``, the push (the trainer's
    export digests, the server's disk load), ``verify``, ``after_sync``."""
    addr = f"127.0.0.1:{client.port}"
    ctx = _ctx(actor, addr, version)
    await asyncio.to_thread(hook.before_push, ctx)
    actor.export(named)
    await _push(client, weights_dir, named)
    await asyncio.to_thread(hook.verify, ctx)
    await asyncio.to_thread(hook.after_sync, ctx)
    return ctx


def _stepped(named):
    return {k: v + 1e-5 * torch.randn_like(v) for k, v in named.items()}


@pytest.mark.parametrize(
    "kind,every",
    [("skipped", 1), ("reverted", 1), ("one_element", 1), ("noise", 1)]
    + [("skipped", 8), ("reverted", 8), ("noise", 8)],
)
async def test_fingerprint_hook_server_with_one_bad_tensor_caught_at_once_naming_it(
    server_app, tiny_model_dir, tmp_path, monkeypatch, kind, every
):
    """The server loads new weights but one tensor is wrong (skipped in the load, reverted
    after it, one unsampled element off, slightly noisy): the very first check names the
    server and that tensor (a logprob tolerance could miss such a change). With the
    rotation (``full_every=8``) and the tensor outside this check's share, the sample
    alone catches a skipped, reverted or noisy tensor at once."""
    srv, make_client = server_app
    new = _stepped(_checkpoint(tiny_model_dir))
    sizes = [(n, t.numel()) for n, t in new.items()]
    assert every == 1 or _FAULTY not in rotation_share(sizes, every, 1)  # sample only
    hook = WeightFingerprintHook(full_every=every)
    actor = _Actor(new)
    async with make_client() as client:
        addr = f"127.0.0.1:{client.port}"
        ctx = await _sync_check(hook, actor, client, tmp_path, new, 1)  # a correct server
        assert ctx.stats["weight_sync/fingerprint_tensors"] == len(new)
        assert ctx.stats["weight_sync/fingerprint_servers"] == 1
        n_full = ctx.stats["weight_sync/fingerprint_full_tensors"]
        assert n_full == len(rotation_share(sizes, every, 0)) > 0

        _inject(monkeypatch, kind)
        with pytest.raises(WeightFingerprintMismatch) as ei:
            await _sync_check(hook, actor, client, tmp_path, _stepped(new), 2)
    err = ei.value
    assert err.server == addr and len(err.tensors) == 1 and err.tensors[0].startswith(_FAULTY)
    assert addr in str(err) and _FAULTY in str(err) and "version 2" in str(err)


async def test_fingerprint_rotation_catches_unsampled_element_off_within_full_every_syncs(
    server_app, tiny_model_dir, tmp_path, monkeypatch
):
    """A server whose loader leaves one element of one tensor off by 1e-4, outside the
    sampled positions, at every load: the samples cannot see it; the rotating row sums
    catch it at the first check whose share holds the tensor, within ``full_every``
    syncs, naming server and tensor."""
    every = 4
    srv, make_client = server_app
    hook = WeightFingerprintHook(full_every=every)
    actor = _Actor(_checkpoint(tiny_model_dir))
    sizes = [(n, t.numel()) for n, t in actor.named.items()]
    due = next(i for i in range(every) if _FAULTY in rotation_share(sizes, every, i)) + 1
    _inject(monkeypatch, "one_element")
    caught = None
    async with make_client() as client:
        addr = f"127.0.0.1:{client.port}"
        for version in range(1, every + 1):
            try:
                await _sync_check(hook, actor, client, tmp_path, _stepped(actor.named), version)
            except WeightFingerprintMismatch as e:
                caught = e
                break
    assert caught is not None, f"not caught within {every} syncs"
    assert caught.version == due <= every  # the check whose share holds the tensor
    assert caught.server == addr and len(caught.tensors) == 1
    assert caught.tensors[0].startswith(f"{_FAULTY} (row-sum projection differs")


async def test_fingerprint_background_check_mismatch_raised_inside_its_sync_naming_it(
    server_app, tiny_model_dir, tmp_path, monkeypatch
):
    """``background=True``: every check still runs inside its sync, before the commit
    (design choice (b)): a good one's stats come with its own sync, a server that skipped
    a tensor is named by that sync's ``verify`` (server, tensor, version); ``flush()``
    has nothing left to raise."""
    srv, make_client = server_app
    hook = WeightFingerprintHook(full_every=8, background=True)
    actor = _Actor(_checkpoint(tiny_model_dir))
    async with make_client() as client:
        addr = f"127.0.0.1:{client.port}"

        async def sync(version):
            named = _stepped(actor.named)
            return await _sync_check(hook, actor, client, tmp_path, named, version)

        assert (await sync(1)).stats["weight_sync/fingerprint_version"] == 1
        assert (await sync(2)).stats["weight_sync/fingerprint_version"] == 2
        _inject(monkeypatch, "skipped")
        with pytest.raises(WeightFingerprintMismatch) as ei:
            await sync(3)
        await asyncio.to_thread(hook.flush)  # nothing deferred to the step boundary
    e = ei.value
    assert e.server == addr and len(e.tensors) == 1 and e.tensors[0].startswith(_FAULTY)
    assert "version 3" in str(e) and addr in str(e)


class _Rotation:
    """The inference engine's rotation: ``healthy_addresses`` and ``exclude_server``."""

    def __init__(self, addresses):
        self.healthy = list(addresses)
        self.excluded = []

    @property
    def healthy_addresses(self):
        return list(self.healthy)

    def exclude_server(self, addr, why=""):
        self.excluded.append(addr)
        self.healthy = [a for a in self.healthy if a != addr]


def test_fingerprint_fetch_hung_server_left_rotation_not_waited_for():
    """A server that accepts the connection but never answers (SIGSTOP-like): once the
    health deadline takes it out of rotation the check stops waiting (not its 300 s)."""
    import socket
    import threading

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(4)  # accepted by the kernel, never answered
    addr = f"127.0.0.1:{hung.getsockname()[1]}"
    rotation = _Rotation([addr])
    threading.Timer(1.0, lambda: rotation.healthy.clear()).start()
    hook = WeightFingerprintHook(timeout=60.0)
    t0 = time.monotonic()
    try:
        assert hook.server_fingerprints([addr], seed=1, rollout=rotation) == {}
    finally:
        hung.close()
    assert time.monotonic() - t0 < 10.0


def test_fingerprint_fetch_refused_connection_excludes_server_or_raises_without_rotation():
    import socket

    import requests

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there: connection refused
    rotation = _Rotation([addr])
    hook = WeightFingerprintHook(timeout=5.0)
    assert hook.server_fingerprints([addr], seed=1, rollout=rotation) == {}
    assert rotation.excluded == [addr]
    with pytest.raises(requests.ConnectionError):
        hook.server_fingerprints([addr], seed=1)


def test_fingerprint_fetch_dropped_connection_to_live_server_retried_once_kept():
    """A connection reset while the server still answers its health probe (the chaos
    soak's dropped connections): retried once, the server stays in rotation."""
    import http.server
    import json
    import socket
    import struct
    import threading

    calls = {"fingerprint": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /health
            self._reply({"status": "ok"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls["fingerprint"] += 1
            if calls["fingerprint"] == 1:  # reset the connection without an answer
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.connection.close()
                return
            self._reply({"fingerprints": {}, "dtypes": {}, "version": 3, "seconds": 0.0})

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    addr = f"127.0.0.1:{srv.server_address[1]}"
    rotation = _Rotation([addr])
    try:
        out = WeightFingerprintHook(timeout=10.0).server_fingerprints([addr], 1, rotation)
    finally:
        srv.shutdown()
    assert calls["fingerprint"] == 2
    assert rotation.excluded == [] and out[addr]["version"] == 3


async def _sync_in_response(hook, actor, client, weights_dir, named, version):
    """One disk sync as ``WeightSynchronizer`` + ``RemoteInfEngine`` run it with the
    fingerprint in the update response: the trainer writes the checkpoint and its
    reference into ``weights_dir``, the server loads it (answering with its fingerprint),
    the engine keeps that answer by address, the hook verifies."""
    from safetensors.torch import save_file

    addr = f"127.0.0.1:{client.port}"
    rollout = types.SimpleNamespace(healthy_addresses=[addr], disk_update_responses={})
    meta = types.SimpleNamespace(type="disk", path=str(weights_dir))
    ctx = WeightSyncContext(version, version - 1, meta, "step", actor, rollout)
    await asyncio.to_thread(hook.before_push, ctx)
    weights_dir.mkdir(parents=True, exist_ok=True)
    save_file(named, str(weights_dir / "model.safetensors"))
    actor.export(named, str(weights_dir))
    r = await client.post(
        "/update_weights_from_disk",
        json={"model_path": str(weights_dir), "version": version},
        headers=auth_headers(get_run_secret()),
    )
    assert r.status == 200, await r.text()
    rollout.disk_update_responses = {addr: await r.json()}
    await asyncio.to_thread(hook.verify, ctx)
    await asyncio.to_thread(hook.after_sync, ctx)
    return ctx


@pytest.mark.parametrize(
    "kind,every,background",
    [
        ("skipped", 1, False),
        ("skipped", 1, True),
        ("reverted", 1, True),
        ("one_element", 1, True),
        ("noise", 8, True),
        ("noise", 8, False),
    ],
)
async def test_fingerprint_in_update_response_bad_tensor_caught_without_extra_request(
    server_app, tiny_model_dir, tmp_path, monkeypatch, kind, every, background
):
    """Disk sync with the reference written next to the weights: the server returns its
    fingerprint with the update, asking neither the trainer nor the server anything more.
    A load that skips, reverts, perturbs one element of (outside the sample) or adds noise
    to one tensor is caught, naming the server, the tensor and the version, inside the
    sync (with ``background=True`` the file first names only the seed and the trainer
    digests its export on a thread; the check waits for it)."""
    srv, make_client = server_app
    hook = WeightFingerprintHook(full_every=every, background=background)
    actor = _Actor(_checkpoint(tiny_model_dir))
    asked_servers = []
    monkeypatch.setattr(hook, "server_fingerprints", lambda *a, **k: asked_servers.append(a))
    new = _stepped(actor.named)
    async with make_client() as client:
        addr = f"127.0.0.1:{client.port}"
        ctx = await _sync_in_response(hook, actor, client, tmp_path / "v1", new, 1)
        assert ctx.stats["weight_sync/fingerprint_in_response_servers"] == 1
        assert ctx.stats["weight_sync/fingerprint_servers"] == 1
        assert ctx.stats["weight_sync/fingerprint_tensors"] == len(new)
        ref = read_reference(str(tmp_path / "v1"))
        assert "deferred" not in ref  # completed (background: by the trainer's thread)
        full = sorted(n for n, fp in ref["fingerprints"].items() if len(fp) > 2)
        assert full == ref["full"]
        _inject(monkeypatch, kind)
        with pytest.raises(WeightFingerprintMismatch) as ei:
            await _sync_in_response(hook, actor, client, tmp_path / "v2", _stepped(new), 2)
    assert actor.asked == 0 and asked_servers == []  # no request beyond the update
    err = ei.value
    assert err.server == addr and len(err.tensors) == 1 and err.tensors[0].startswith(_FAULTY)
    assert addr in str(err) and _FAULTY in str(err) and "version 2" in str(err)


async def test_fingerprint_in_update_response_rotation_covers_every_tensor_within_full_every(
    server_app, tiny_model_dir, tmp_path, monkeypatch
):
    """The written references rotate: over ``every`` syncs every tensor too big to be
    sampled whole is digested in full once, so an unsampled element off by 1e-4 is caught
    within ``every`` syncs, as a row-sum difference."""
    every = 4
    srv, make_client = server_app
    hook = WeightFingerprintHook(full_every=every)
    actor = _Actor(_checkpoint(tiny_model_dir))
    sizes = [(n, t.numel()) for n, t in actor.named.items()]
    big = {n for n, k in sizes if k > FULL_SAMPLE_MAX}
    seen: list[set[str]] = []
    async with make_client() as client:
        for version in range(1, every + 1):
            d = tmp_path / f"v{version}"
            await _sync_in_response(hook, actor, client, d, _stepped(actor.named), version)
            seen.append(set(read_reference(str(d))["full"]))
        assert set().union(*seen) == big and sum(map(len, seen)) == len(big)
        _inject(monkeypatch, "one_element")
        caught = None
        for version in range(every + 1, 2 * every + 1):
            try:
                d = tmp_path / f"v{version}"
                await _sync_in_response(hook, actor, client, d, _stepped(actor.named), version)
            except WeightFingerprintMismatch as e:
                caught = e
                break
    assert caught is not None and caught.version <= 2 * every
    assert caught.tensors[0].startswith(f"{_FAULTY} (row-sum projection differs")
    assert actor.asked == 0


async def test_fingerprint_update_answer_without_fingerprint_falls_back_to_a_request(
    server_app, tiny_model_dir, tmp_path, monkeypatch
):
    """A server whose update answer has no fingerprint (an older server) or one for another
    seed (it loaded another directory) is asked with ``/weights_fingerprint`` for the
    reference's seed and names in full, still without asking the trainer."""
    srv, make_client = server_app
    hook = WeightFingerprintHook(full_every=2)
    actor = _Actor(_checkpoint(tiny_model_dir))
    real = hook.server_fingerprints
    asked = []

    def spy(addresses, seed, rollout=None, full=None):
        asked.append((list(addresses), seed, sorted(full or [])))
        return real(addresses, seed, rollout, full)

    monkeypatch.setattr(hook, "server_fingerprints", spy)
    async with make_client() as client:
        addr = f"127.0.0.1:{client.port}"
        d = tmp_path / "v1"
        d.mkdir()
        from safetensors.torch import save_file

        rollout = types.SimpleNamespace(healthy_addresses=[addr], disk_update_responses={})
        ctx = WeightSyncContext(
            1, 0, types.SimpleNamespace(type="disk", path=str(d)), "step", actor, rollout
        )
        await asyncio.to_thread(hook.before_push, ctx)
        named = _stepped(actor.named)
        save_file(named, str(d / "model.safetensors"))
        actor.export(named, str(d))
        await _push(client, d, named)  # the answer is not kept: as from an older server
        await asyncio.to_thread(hook.verify, ctx)
        ref = read_reference(str(d))
        assert asked == [([addr], ref["seed"], ref["full"])]
        assert ctx.stats["weight_sync/fingerprint_in_response_servers"] == 0
        assert ctx.stats["weight_sync/fingerprint_servers"] == 1 and actor.asked == 0
        _inject(monkeypatch, "skipped")
        named = _stepped(named)
        actor.export(named, str(d))  # a new reference (seed) for the new weights
        ref = read_reference(str(d))
        rollout.disk_update_responses = {addr: {"fingerprint": {"seed": ref["seed"] + 1}}}
        await _push(client, d, named)
        with pytest.raises(WeightFingerprintMismatch) as ei:
            await asyncio.to_thread(hook.verify, ctx)
    assert len(asked) == 2
    assert ei.value.server == addr and ei.value.tensors[0].startswith(_FAULTY)


async def test_fingerprint_in_update_response_bf16_server_learns_dtypes_then_no_request(
    tiny_model_dir, tmp_path
):
    """A bf16 server of a float32 trainer: the first check from the update answer differs
    only by the cast, so the trainer recomputes once in the server's dtypes (one request)
    and digests later exports in them; the next checks need no request and pass."""
    from aiohttp.test_utils import TestClient, TestServer

    from areal.inference.server.app import LocalInferenceServer

    torch.set_num_threads(1)
    srv = LocalInferenceServer.from_pretrained(tiny_model_dir, dtype="bfloat16", device="cpu")
    hook = WeightFingerprintHook(full_every=4, background=True)
    actor = _Actor(_checkpoint(tiny_model_dir))
    async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as client:
        named = _stepped(actor.named)
        ctx = await _sync_in_response(hook, actor, client, tmp_path / "v1", named, 1)
        assert ctx.stats["weight_sync/fingerprint_in_response_servers"] == 1
        assert actor.asked == 1 and actor.dtypes["model.norm.weight"] == "bfloat16"
        for version in (2, 3):
            named = _stepped(named)
            d = tmp_path / f"v{version}"
            stats = (await _sync_in_response(hook, actor, client, d, named, version)).stats
            assert stats["weight_sync/fingerprint_servers"] == 1
            assert stats["weight_sync/fingerprint_version"] == version
        assert actor.asked == 1


@pytest.mark.parametrize("mode", ["inline", "threaded", "deferred"])
def test_fingerprint_fsdp_export_writes_reference_of_saved_weights_only_under_root(
    tiny_model_dir, tmp_path, monkeypatch, mode
):
    """``FSDPEngine``: after ``enable_weight_fingerprints(every, reference_root=R)`` an HF
    save below ``R`` writes the reference of exactly the weights it saved (digested inline
    or on the digest thread), the rotation moving on by one share per reference; a save
    elsewhere (a checkpoint) writes none and does not move it. ``deferred=True``: the file
    only names the seed and the names in full; ``fingerprint_reference(seed)`` digests the
    export afterwards (a checkpoint saved meanwhile does not replace it), once."""
    from _train_config import tiny_train_config

    import areal.engine.fsdp.engine as fe
    import areal.engine.fsdp.fingerprints as fp
    from areal.api.io_struct import FinetuneSpec

    monkeypatch.setattr(fp, "DIGEST_THREAD_MIN_BYTES", 0 if mode == "threaded" else 1 << 60)
    monkeypatch.setattr(fp, "DEFER_DIGEST_MIN_BYTES", 0)  # the tiny model deferred too
    config = tiny_train_config(tiny_model_dir)
    eng = fe.FSDPEngine(config)
    eng.create_process_group()
    try:
        eng.initialize(None, FinetuneSpec(1, 10, 1))
        every, root = 3, tmp_path / "wu"
        deferred = mode == "deferred"
        eng.enable_weight_fingerprints(every, reference_root=str(root), deferred=deferred)
        shares = []
        for i in range(every):
            eng._save_hf(str(tmp_path / f"ckpt{i}"))  # not below the root
            assert read_reference(str(tmp_path / f"ckpt{i}")) is None
            d = root / f"v{i}"
            eng._save_hf(str(d))
            ref = read_reference(str(d))
            saved = _checkpoint(str(d))
            if deferred:  # completed by a thread (joined by the next export)
                assert eng._deferred_export is not None
                eng._save_hf(str(tmp_path / f"ckpt{i}"))  # meanwhile: a checkpoint
                assert eng._deferred_export is None
                req, ref = ref, read_reference(str(d))
                assert ref["seed"] == req["seed"] and ref["full"] == req["full"]
                assert "deferred" not in ref
            assert ref["fingerprints"] == fingerprint_named(saved, ref["seed"], full=ref["full"])
            shares.append(set(ref["full"]))
        sizes = [(n, t.numel()) for n, t in _checkpoint(str(root / "v0")).items()]
        assert shares == [rotation_share(sizes, every, i) for i in range(every)]
    finally:
        eng.destroy()
