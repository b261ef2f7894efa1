"""In-flight weight updates on the built-in server (``rollout.inflight_weight_updates``).

A versioned update of full weights is staged beside the live ones while the server keeps
generating, and swapped in between two decode steps at commit; a rollback drops it. What
must hold: a request running across the update is never interrupted (one request, tokens
of the old version then of the new one), no token is ever produced from weights still
pending, a rolled-back update leaves the served weights as they were, and after the
commit new requests are served exactly by the pushed weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
import requests
import torch

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.inference.server.weights import StagedWeights, load_weights_from_disk

PROMPT = [11, 52, 7, 300, 41]


def _save_perturbed(src: str, dst: str, scale: float = 0.3, seed: int = 1) -> str:
    """``src``'s model with Gaussian noise (``scale`` x each tensor's std) on every weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(scale * float(p.std()) * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def _hf_logprobs(model_dir: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from areal.inference.clients.local import RemoteLocalEngine

    eng = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=180, request_timeout=60))
    try:
        eng.launch_server({"model_path": tiny_model_dir, "num_servers": 1})
        eng.initialize(train_data_parallel_size=1)
        yield eng
    finally:
        eng.destroy()
        eng.teardown_server()


@pytest.fixture(scope="module")
def new_dir(tiny_model_dir, tmp_path_factory) -> str:
    return _save_perturbed(tiny_model_dir, str(tmp_path_factory.mktemp("new") / "v1"))


def _get(engine, path: str) -> dict:
    return requests.get(f"http://{engine.addresses[0]}{path}", timeout=10).json()


def _meta(path: str, version: int) -> WeightUpdateMeta:
    return dataclasses.replace(WeightUpdateMeta(type="disk", path=path), version=version)


def _greedy(engine, n: int = 8):
    g = GenerationHyperparameters(max_new_tokens=n, greedy=True, ignore_eos=True)
    return asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))


def test_local_backend_takes_full_weights_in_flight_and_pauses_for_adapters(engine):
    assert engine.updates_in_flight(WeightUpdateMeta(type="disk", path="/x"))
    assert engine.updates_in_flight(WeightUpdateMeta(type="xccl"))
    assert not engine.updates_in_flight(WeightUpdateMeta(type="disk", path="/x", use_lora=True))
    engine.config.inflight_weight_updates = False
    try:
        assert not engine.updates_in_flight(WeightUpdateMeta(type="disk", path="/x"))
    finally:
        engine.config.inflight_weight_updates = True


def test_pending_weights_never_serve_and_a_rollback_leaves_the_live_ones(
    engine, new_dir, tiny_model_dir
):
    version = engine.get_version()
    before = _greedy(engine)
    engine.update_weights_from_disk(_meta(new_dir, version + 1)).result()
    assert _get(engine, "/health")["version"] == version  # still the old version
    during = _greedy(engine)  # a request served while the update is pending
    assert during.output_tokens == before.output_tokens
    assert during.output_versions == [version] * len(during.output_tokens)
    torch.testing.assert_close(
        torch.tensor(during.output_logprobs), torch.tensor(before.output_logprobs)
    )
    engine.rollback_weights(None)
    after = _greedy(engine)
    assert after.output_tokens == before.output_tokens
    old = _hf_logprobs(tiny_model_dir, PROMPT, after.output_tokens)
    torch.testing.assert_close(torch.tensor(after.output_logprobs), old, atol=1e-4, rtol=0)


def test_request_running_across_the_commit_is_not_interrupted(engine, new_dir):
    """One long request spans the update: its tokens carry the old version up to the
    commit and the new one after it, the server finished exactly one request (an
    interrupted one would be delivered twice: the aborted chunk, then the resumed rest),
    and a request after the commit is served exactly by the new weights."""
    v0 = engine.get_version()
    n = 500  # gconfig.max_tokens (512) holds prompt + 507; ~0.7 s of decoding
    g = GenerationHyperparameters(max_new_tokens=n, greedy=True, ignore_eos=True)
    finished0 = _get(engine, "/metrics")["finished_requests_total"]
    generated0 = _get(engine, "/metrics")["generated_tokens_total"]

    async def scenario():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        deadline = time.monotonic() + 30
        while _get(engine, "/metrics")["generated_tokens_total"] - generated0 < 20:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.005)
        await loop.run_in_executor(
            None, lambda: engine.update_weights_from_disk(_meta(new_dir, v0 + 1)).result()
        )
        assert not task.done(), "the request ended before the commit: make it longer"
        await loop.run_in_executor(None, lambda: engine.commit_weights(v0 + 1))
        return await task

    resp = asyncio.run(scenario())
    assert len(resp.output_tokens) == n and resp.stop_reason == "length"
    k = resp.output_versions.index(v0 + 1)
    assert 20 <= k < n
    assert resp.output_versions == [v0] * k + [v0 + 1] * (n - k)
    assert _get(engine, "/metrics")["finished_requests_total"] == finished0 + 1
    engine.set_version(v0 + 1)
    fresh = _greedy(engine)
    assert fresh.output_versions == [v0 + 1] * len(fresh.output_tokens)
    new = _hf_logprobs(new_dir, PROMPT, fresh.output_tokens)
    torch.testing.assert_close(torch.tensor(fresh.output_logprobs), new, atol=1e-4, rtol=0)


def _tiny_tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def test_staged_weights_go_live_only_at_commit_with_tied_embeddings(tmp_path):
    model = _tiny_tied_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    target = _tiny_tied_model()
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1.0)
    target.save_pretrained(str(tmp_path), safe_serialization=True)
    want = {n: p.detach().clone() for n, p in target.named_parameters()}
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    staged = StagedWeights()
    staged.begin(model, 1)
    load_weights_from_disk(model, str(tmp_path), into=staged.targets())
    for n, p in model.named_parameters():  # nothing live moved
        assert torch.equal(p, live[n]), n
    assert staged.commit(model) > 0 and not staged.active
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for n, b in model.named_buffers():  # never in a checkpoint: kept as they were
        assert torch.equal(b, buffers[n]), n

    # a dropped update leaves the live weights; the next one starts from them again
    staged.begin(model, 2)
    with torch.no_grad():
        for t in staged.targets().values():
            t.zero_()
    assert staged.discard() and staged.commit(model) == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n
    staged.begin(model, 3)
    assert all(
        torch.equal(staged.targets()[n], p)
        for n, p in model.named_parameters()
        if n in staged.targets()
    )


def test_failed_staged_load_is_dropped(engine, tmp_path):
    bad = str(tmp_path / "empty")
    os.makedirs(bad)
    with pytest.raises(Exception, match="no \\*.safetensors"):
        engine.update_weights_from_disk(_meta(bad, engine.get_version() + 1)).result()
    assert "pending_version" not in _get(engine, "/get_version")
