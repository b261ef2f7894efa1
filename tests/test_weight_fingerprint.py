"""Weight fingerprints (areal.utils.weight_fingerprint) and the verifying sync hook
(areal.infra.weight_verify) against a real built-in server app on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import time
import types

import pytest
import torch

from areal.infra.weight_sync import WeightSyncContext
from areal.infra.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch
from areal.utils.auth import auth_headers, get_run_secret
from areal.utils.weight_fingerprint import (
    WeightDigests,
    compare_fingerprints,
    digest_tensor,
    fingerprint_named,
    fingerprint_tensor,
)


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


def test_fingerprint_from_digests_equals_live_and_sees_later_changes(monkeypatch):
    """Digests taken when the tensors were written (server load, trainer export) give the
    same fingerprints as the live tensors; the sample is read live, so a tensor changed
    after its digest was taken still mismatches."""
    torch.manual_seed(0)
    named = {"a": torch.randn(300, 70) * 0.02, "b": torch.randn(5000, 64) * 0.02}
    digests = {n: digest_tensor(n, t) for n, t in named.items()}
    live = fingerprint_named(named, seed=9)
    assert fingerprint_named(named, seed=9, digests=digests) == live
    exported = WeightDigests()
    for n, t in named.items():
        exported.add(n, t)
    exported.complete = True
    assert exported.usable and exported.fingerprints(9) == live
    assert fingerprint_named(named, seed=10) != live  # the seed changes every number
    named["b"] += 1e-5 * torch.randn_like(named["b"])  # changed after the load's digest
    bad = compare_fingerprints(live, fingerprint_named(named, seed=9, digests=digests))
    assert len(bad) == 1 and bad[0].startswith("b (sampled elements differ")
    monkeypatch.setenv("AREAL_WEIGHT_DIGESTS", "0")
    off = WeightDigests()
    off.add("a", named["a"])
    assert not off.usable and off.digests == {}


@pytest.fixture
def server_app(tiny_model_dir):
    """A built-in server app (tiny model) and a function making its test client (inside
    the test's event loop: a real socket on 127.0.0.1)."""
    from aiohttp.test_utils import TestClient, TestServer

    from areal.engine.local_server.app import LocalInferenceServer

    torch.set_num_threads(1)
    srv = LocalInferenceServer.from_pretrained(tiny_model_dir)
    return srv, lambda: TestClient(TestServer(srv.build_app(), host="127.0.0.1"))


def _checkpoint(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


class _Actor:
    """The trainer side: fingerprints of the weights it exported (``weights_fingerprint``)."""

    def __init__(self, named):
        self.named = named

    def weights_fingerprint(self, seed, dtypes=None):
        return fingerprint_named(self.named, seed, dtypes)


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
    ref = fingerprint_named(_checkpoint(tiny_model_dir), 3)
    assert compare_fingerprints(ref, body["fingerprints"]) == []
    assert body["dtypes"]["model.embed_tokens.weight"] == "float32"


_FAULTY = "model.layers.1.mlp.down_proj.weight"


def _fault(kind, real_load, model, path, **kw):
    """Load ``path`` into ``model`` the way a server with bug ``kind`` would: the tensor
    ``_FAULTY`` keeps its old value (``skipped``: the loader never copies it; ``reverted``:
    something restores it after the load), is off in one element by 1e-4 (``one_element``)
    or carries noise 10x smaller than one step between versions (``noise``)."""
    import safetensors.torch as st

    import areal.engine.local_server.weights as weights

    old = dict(model.named_parameters())[_FAULTY].detach().clone()
    real_load_file = st.load_file

    def load_file(f, *a, **k):
        sd = real_load_file(f, *a, **k)
        if _FAULTY in sd:
            if kind == "skipped":
                sd[_FAULTY] = old.clone()
            elif kind == "one_element":
                sd[_FAULTY] = sd[_FAULTY].clone()
                sd[_FAULTY].view(-1)[777] += 1e-4
            elif kind == "noise":
                sd[_FAULTY] = sd[_FAULTY] + 1e-6 * torch.randn_like(sd[_FAULTY])
        return sd

    st.load_file = load_file
    try:
        n = real_load(model, path, **kw)
    finally:
        st.load_file = real_load_file
    assert weights.load_weights_from_disk is not real_load
    if kind == "reverted":
        with torch.no_grad():
            dict(model.named_parameters())[_FAULTY].copy_(old)
    return n


@pytest.mark.parametrize("kind", ["skipped", "reverted", "one_element", "noise"])
async def test_fingerprint_hook_server_with_one_bad_tensor_caught_at_once_naming_it(
    server_app, tiny_model_dir, tmp_path, monkeypatch, kind
):
    """The server loads new weights but one tensor is wrong (skipped in the load, reverted
    after it, one element off, slightly noisy): the very first verify names the server and
    that tensor (a logprob tolerance could miss such a change)."""
    import functools

    from safetensors.torch import save_file

    import areal.engine.local_server.weights as weights

    srv, make_client = server_app
    new = {k: v + 1e-5 * torch.randn_like(v) for k, v in _checkpoint(tiny_model_dir).items()}
    new_dir = tmp_path / "v1"
    new_dir.mkdir()
    save_file(new, str(new_dir / "model.safetensors"))

    hook = WeightFingerprintHook()
    async with make_client() as client:
        addr = f"127.0.0.1:{client.port}"
        headers = auth_headers(get_run_secret())
        r = await client.post(
            "/update_weights_from_disk", json={"model_path": str(new_dir)}, headers=headers
        )
        assert r.status == 200
        ctx = _ctx(_Actor(new), addr)
        await asyncio.to_thread(hook.verify, ctx)  # a correct server passes
        assert ctx.stats["weight_sync/fingerprint_tensors"] == len(new)
        assert ctx.stats["weight_sync/fingerprint_servers"] == 1
        assert set(srv.weight_digests) == set(new)  # digested during the load

        monkeypatch.setattr(
            weights,
            "load_weights_from_disk",
            functools.partial(_fault, kind, weights.load_weights_from_disk),
        )
        newer = {k: v + 1e-5 * torch.randn_like(v) for k, v in new.items()}
        save_file(newer, str(new_dir / "model.safetensors"))
        r = await client.post(
            "/update_weights_from_disk", json={"model_path": str(new_dir)}, headers=headers
        )
        assert r.status == 200
        with pytest.raises(WeightFingerprintMismatch) as ei:
            await asyncio.to_thread(hook.verify, _ctx(_Actor(newer), addr, version=2))
    err = ei.value
    assert err.server == addr and len(err.tensors) == 1 and err.tensors[0].startswith(_FAULTY)
    assert addr in str(err) and _FAULTY in str(err) and "version 2" in str(err)


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
