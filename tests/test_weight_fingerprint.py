"""Weight fingerprints (areal.utils.weight_fingerprint) and the verifying sync hook
(areal.infra.weight_verify) against a real built-in server app on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import types

import pytest
import torch

from areal.infra.weight_sync import WeightSyncContext
from areal.infra.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch
from areal.utils.auth import auth_headers, get_run_secret
from areal.utils.weight_fingerprint import (
    compare_fingerprints,
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


async def test_fingerprint_hook_server_skipping_one_tensor_caught_at_once(
    server_app, tiny_model_dir, tmp_path, monkeypatch
):
    """The server loads new weights but silently skips one tensor: the very first verify
    names the server and that tensor (a logprob tolerance could miss such a change)."""
    from safetensors.torch import save_file

    import areal.engine.local_server.weights as weights

    srv, make_client = server_app
    new = {k: v + 1e-5 * torch.randn_like(v) for k, v in _checkpoint(tiny_model_dir).items()}
    new_dir = tmp_path / "v1"
    new_dir.mkdir()
    save_file(new, str(new_dir / "model.safetensors"))
    skipped = "model.layers.1.mlp.down_proj.weight"
    real_load = weights.load_weights_from_disk

    def load_skipping_one(model, path):
        old = dict(model.named_parameters())[skipped].detach().clone()
        n = real_load(model, path)
        with torch.no_grad():
            dict(model.named_parameters())[skipped].copy_(old)  # the "bug"
        return n

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

        monkeypatch.setattr(weights, "load_weights_from_disk", load_skipping_one)
        newer = {k: v + 1e-5 * torch.randn_like(v) for k, v in new.items()}
        save_file(newer, str(new_dir / "model.safetensors"))
        r = await client.post(
            "/update_weights_from_disk", json={"model_path": str(new_dir)}, headers=headers
        )
        assert r.status == 200
        with pytest.raises(WeightFingerprintMismatch) as ei:
            await asyncio.to_thread(hook.verify, _ctx(_Actor(newer), addr, version=2))
    err = ei.value
    assert err.server == addr and len(err.tensors) == 1 and err.tensors[0].startswith(skipped)
    assert addr in str(err) and skipped in str(err) and "version 2" in str(err)
