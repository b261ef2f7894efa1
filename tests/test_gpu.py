"""CUDA paths: bf16 FSDP2 over NCCL, the built-in server on CUDA.

Every test here is ``@pytest.mark.gpu`` and skips with a reason when CUDA is absent
(``make gpu-check`` runs them on a GPU machine). They compare against references
computed in the same process, so they hold on any CUDA device.
"""

from __future__ import annotations

import random

import pytest
import torch
from _dist_helpers import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]

EOS = 2


def _hf_cuda(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


@torch.no_grad()
def _hf_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output], device="cuda")
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output, device="cuda").unsqueeze(1)).squeeze(1).cpu()


def test_generation_core_cuda_greedy_tokens_and_logprobs_match_hf(tiny_model_dir):
    from concurrent.futures import Future

    from areal.engine.local_server.core import GenerationCore, SamplingParams

    model = _hf_cuda(tiny_model_dir)
    core = GenerationCore(_hf_cuda(tiny_model_dir), max_batch_size=16)
    assert core.device.type == "cuda"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    futs = []
    try:
        for i, p in enumerate(prompts):
            fut: Future = Future()
            core.submit(
                f"r{i}",
                p,
                SamplingParams(max_new_tokens=16, greedy=True),
                lambda res, f=fut: f.set_result(res),
            )
            futs.append(fut)
        results = [f.result(timeout=120) for f in futs]
    finally:
        core.shutdown()
    for p, res in zip(prompts, results):
        out = res["output_ids"]
        ref = model.generate(
            torch.tensor([p], device="cuda"),
            attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        # the same greedy tokens as HF, EOS included, up to the same length
        assert len(out) > 0 and out == ref, (out, ref)
        lp = torch.tensor(res["output_logprobs"])
        assert torch.allclose(lp, _hf_logprobs(model, p, out), atol=1e-3)


def test_generation_core_cuda_seeded_sampling_reproducible(tiny_model_dir):
    from concurrent.futures import Future

    from areal.engine.local_server.core import GenerationCore, SamplingParams

    def run_once():
        core = GenerationCore(_hf_cuda(tiny_model_dir), max_batch_size=4)
        try:
            fut: Future = Future()
            core.submit(
                "s",
                [5, 6, 7, 8],
                SamplingParams(max_new_tokens=12, temperature=1.0, seed=123),
                fut.set_result,
            )
            return fut.result(timeout=120)["output_ids"]
        finally:
            core.shutdown()

    assert run_once() == run_once()


def test_http_server_on_cuda_serves_completions(tiny_model_dir):
    import requests

    from areal.engine.local_server.launch import launch_local_server

    group = launch_local_server(tiny_model_dir, num_servers=1, timeout=300)
    try:
        addr = group.addresses[0]
        r = requests.post(
            f"http://{addr}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "logprobs": 1},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        metrics = requests.get(f"http://{addr}/metrics", timeout=30).json()
        assert metrics["device"].startswith("cuda"), metrics
    finally:
        group.shutdown()


def _bf16_nccl_session(rank, world_size, path):
    from test_fsdp_engine import loss_fn, loss_weight_fn, make_batch, make_config

    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    cfg = make_config(path, lr=1e-3)
    cfg.dtype = "bfloat16"
    eng = FSDPEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    assert eng.device.type == "cuda"
    assert torch.distributed.get_backend() == "nccl"
    batch = make_batch()
    fwd0 = eng.forward_batch(batch)
    losses = []
    for _ in range(5):
        stats = eng.train_batch(batch, loss_fn, loss_weight_fn)
        losses.append(float(stats["loss"]))
    return {"fwd0": fwd0.float().cpu(), "losses": losses, "stats": stats}


def test_fsdp_bf16_nccl_logprobs_close_to_fp32_and_training_lowers_loss(tmp_path):
    from conftest import build_tiny_qwen2
    from test_fsdp_engine import make_batch, reference_logprobs

    path = build_tiny_qwen2(str(tmp_path / "m"))
    res = run_ranks(_bf16_nccl_session, 1, (path,), timeout=600)[0]
    batch = make_batch()
    ref = reference_logprobs(path, batch)
    m = batch["loss_mask"].bool()
    # bf16 has ~3 significant digits; the tiny model's logprobs are O(1).
    assert (res["fwd0"][m] - ref[m]).abs().max() < 0.1
    losses = res["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
