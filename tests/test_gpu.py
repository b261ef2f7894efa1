"""CUDA paths: bf16 FSDP2 and ArchonEngine (1 rank; d1t2 with 2 GPUs) over NCCL, the
built-in server on CUDA.

Every test here is ``@pytest.mark.gpu`` and skips with a reason when CUDA is absent
(``make gpu-check`` runs them on a GPU machine). They compare against references
computed in the same process, so they hold on any CUDA device.
"""

from __future__ import annotations

import os
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

    from areal.inference.server.core import GenerationCore, SamplingParams

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

    from areal.inference.server.core import GenerationCore, SamplingParams

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

    from areal.inference.server.launch import launch_local_server

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


# ------------------------------------------------------------------------ ArchonEngine
# The body of each Archon test is a helper taking (device, backend, dtype): the tests run
# it on CUDA/NCCL/bf16. The engine picks its device itself (CUDA when available), so the
# helpers check that it did what was asked; on a machine without CUDA they run on
# ("cpu", "gloo", torch.float32) (or bfloat16, through cpu_compute_dtype).
_ARCHON_TOL = {
    # bf16 has ~3 significant digits: the tiny models' logprobs are O(1), the losses O(6)
    torch.bfloat16: {"logp": 0.1, "loss": 0.05},
    torch.float32: {"logp": 1e-4, "loss": 1e-4},
}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _tiny_archon_model(family: str, path: str) -> str:
    if family == "qwen3_moe":  # 4 experts, top 2 (vocab 400: the batches' token ids)
        from test_archon_moe import hf_moe

        hf_moe(seed=0, vocab=400).save_pretrained(path)
        return path
    from test_archon_engine import build_tiny_qwen3

    return build_tiny_qwen3(path)


def _archon_session(rank, world_size, path, layout, device, backend, dtype, steps, export_dir):
    """ArchonEngine at ``archon:{layout}``: forward of the fixed batch, ``steps`` Adam
    steps on it; with ``export_dir``: the forward after training, the parameters (archon
    names) and exported tensors (HF names) gathered in float32, and the HF save."""
    from test_fsdp_engine import loss_fn, loss_weight_fn, make_batch, make_config

    from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
    from areal.engine.archon import ArchonEngine

    cfg = make_config(path, lr=1e-3)
    cfg.backend = f"archon:{layout}"
    cfg.dtype = dtype
    if device == "cpu":  # on CPU the compute dtype is cpu_compute_dtype's
        cfg.cpu_compute_dtype = dtype
    eng = ArchonEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    assert eng.device.type == device, eng.device
    assert torch.distributed.get_backend() == backend
    assert eng.dtype == getattr(torch, dtype), eng.dtype

    def full(t):
        t = t.detach()
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).float().cpu().clone()

    batch = make_batch()
    res = {"fwd0": eng.forward_batch(batch).float().cpu(), "losses": [], "grad_norms": []}
    for _ in range(steps):
        stats = eng.train_batch(batch, loss_fn, loss_weight_fn)
        res["losses"].append(float(stats["loss"]))
        res["grad_norms"].append(float(stats["grad_norm"]))
    if export_dir:
        res["fwd_end"] = eng.forward_batch(batch).float().cpu()
        res["params"] = {
            k.replace("_checkpoint_wrapped_module.", ""): full(v)
            for k, v in eng.model.named_parameters()
        }
        res["export"] = {k: full(v) for k, v in eng._export_tensors().items()}
        eng.save(SaveLoadMeta(path=export_dir, weight_format="hf"))
    eng.destroy()
    return res


def _check_archon_one_rank(tmp_path, family, device, backend, dtype):
    """One rank (``archon:d1``): per-token logprobs of the engine's forward close to fp32
    transformers on CPU, 5 Adam steps on a fixed batch lower the loss, and the HF save
    loads back in transformers (no missing/unexpected keys) with the engine's parameters
    (rounded to the export dtype: exactly) and the engine's logprobs."""
    from safetensors.torch import load_file
    from test_archon_engine import load_safetensors_once
    from test_fsdp_engine import make_batch, reference_logprobs
    from transformers import AutoModelForCausalLM

    from areal.models.archon import get_model_spec

    tol = _ARCHON_TOL[dtype]
    path = _tiny_archon_model(family, str(tmp_path / family))
    export_dir = str(tmp_path / f"{family}_hf")
    args = (path, "d1", device, backend, _DTYPE_NAMES[dtype], 5, export_dir)
    res = run_ranks(_archon_session, 1, args, timeout=600)[0]
    batch = make_batch()
    m = batch["loss_mask"].bool()
    ref = reference_logprobs(path, batch)
    err = (res["fwd0"][m] - ref[m]).abs()
    assert err.max() < tol["logp"], (family, err.max(), err.mean())
    losses = res["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses

    # the HF save: every exported tensor once, in the export dtype (the engine's dtype on
    # CUDA, float32 on CPU), equal to the trained parameter rounded to it
    export_dtype = dtype if device == "cuda" else torch.float32
    saved = load_safetensors_once(export_dir)
    assert set(saved) == set(res["export"])
    for k, v in res["export"].items():
        assert saved[k].dtype == export_dtype, (k, saved[k].dtype)
        assert torch.equal(saved[k], v.to(export_dtype)), k
    initial: dict[str, torch.Tensor] = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            initial.update(load_file(os.path.join(path, f)))
    moved = [k for k in saved if k in initial and not torch.equal(saved[k].float(), initial[k])]
    assert len(moved) > len(saved) // 2, "the save does not hold the trained weights"

    # transformers loads it: no key left over, its parameters are the engine's
    model, info = AutoModelForCausalLM.from_pretrained(
        export_dir, dtype=torch.float32, output_loading_info=True
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info[key])
    assert model.config.model_type == family
    spec = get_model_spec(family)
    adapter = spec.state_dict_adapter_class(spec.model_args_class.from_hf_config(model.config))
    loaded = adapter.from_hf(model.state_dict())
    assert set(loaded) == set(res["params"])
    for k, v in res["params"].items():
        assert torch.equal(loaded[k], v.to(export_dtype).float()), k
    # and scores the batch (in float32) as the trained engine does
    after = reference_logprobs(export_dir, batch)
    err = (res["fwd_end"][m] - after[m]).abs()
    assert err.max() < tol["logp"], (family, err.max(), err.mean())
    return res


def _check_archon_tp2_equals_one_rank(tmp_path, device, backend, dtype):
    """``archon:d1t2`` on 2 ranks: the same forward logprobs and first-step loss (and
    the second step's, after one Adam update) as ``archon:d1`` on 1 rank."""
    from test_fsdp_engine import make_batch

    tol = _ARCHON_TOL[dtype]
    path = _tiny_archon_model("qwen3", str(tmp_path / "qwen3"))
    name = _DTYPE_NAMES[dtype]
    one = run_ranks(_archon_session, 1, (path, "d1", device, backend, name, 2, None), timeout=600)
    two = run_ranks(_archon_session, 2, (path, "d1t2", device, backend, name, 2, None), timeout=600)
    one = one[0]
    m = make_batch()["loss_mask"].bool()
    for r in (two[0], two[1]):
        for got, want in zip(r["losses"], one["losses"], strict=True):
            assert abs(got - want) < tol["loss"], (r["losses"], one["losses"])
        err = (r["fwd0"][m] - one["fwd0"][m]).abs()
        assert err.max() < tol["logp"], (err.max(), err.mean())
    return one, two


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_archon_bf16_nccl_logprobs_close_to_fp32_training_lowers_loss_hf_save_loads(
    tmp_path, family
):
    _check_archon_one_rank(tmp_path, family, "cuda", "nccl", torch.bfloat16)


def test_archon_bf16_nccl_tp2_loss_equals_one_rank(tmp_path):
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(
            f"archon:d1t2 needs 2 GPUs (NCCL refuses two ranks on one GPU); this machine has {n}"
        )
    _check_archon_tp2_equals_one_rank(tmp_path, "cuda", "nccl", torch.bfloat16)
