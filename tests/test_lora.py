"""LoRA: peft-wrapped FSDP engine, merged export, adapter-only weight sync to the built-in
server (its logprobs equal the trainer's merged model), vLLM request format."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from areal.engine.lora import LoRASyncHook
from areal.models.lora_adapter import (
    adapter_deltas,
    apply_adapter,
    merge_adapter_into_checkpoint,
    read_adapter,
)


def _lora_config(path: str, **kw):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    return TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        optimizer=OptimizerConfig(lr=2e-2, warmup_steps_proportion=0.0, weight_decay=0.0),
        mb_spec=MicroBatchSpec(),
        num_threads=1,
        use_lora=True,
        lora_rank=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        **kw,
    )


def _batch(seed: int = 0, b: int = 4, t: int = 12, vocab: int = 400):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(b, t, dtype=torch.bool),
        "loss_mask": torch.ones(b, t, dtype=torch.long),
    }


def _nll(logprobs, entropy, data):
    m = data["loss_mask"].bool()
    return -(logprobs * m).sum() / m.sum()


def _weight(data):
    return data["loss_mask"].count_nonzero()


@pytest.fixture
def lora_engine(tiny_model_dir):
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    eng = FSDPEngine(_lora_config(tiny_model_dir))
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    yield eng
    eng.destroy()


def test_lora_engine_trains_only_adapter_weights(lora_engine):
    model = lora_engine.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_engine.train_batch(_batch(), _nll, _weight)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p.detach(), base[n]), n
    # lora_B starts at 0 and has moved: the exported weights now differ from the base
    assert any(p.detach().abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_lora_hf_save_is_the_merged_model_and_keeps_the_adapter(lora_engine, tmp_path):
    from transformers import AutoModelForCausalLM

    for s in range(2):
        lora_engine.train_batch(_batch(s), _nll, _weight)
    out = str(tmp_path / "hf")
    lora_engine._save_hf(out)
    assert os.path.isfile(os.path.join(out, "lora_adapter", "adapter_config.json"))
    batch = _batch(7)
    want = lora_engine.forward_batch(batch)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"]).logits.float()
    got = torch.zeros_like(want)
    got[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # offline merge of the saved adapter into the base gives the same weights
    merged = merge_adapter_into_checkpoint(
        lora_engine.config.path, os.path.join(out, "lora_adapter"), str(tmp_path / "m")
    )
    m2 = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    for (n, a), (_, b) in zip(hf.named_parameters(), m2.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=n)


def test_apply_adapter_replaces_previous_adapter_instead_of_accumulating(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from areal.models.lora_adapter import write_adapter

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    w0 = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    a = torch.randn(2, w0.shape[1])
    b = torch.randn(w0.shape[0], 2)
    write_adapter(str(tmp_path / "a1"), {f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b},
                  rank=2, alpha=4, targets=["q_proj"])  # fmt: skip
    write_adapter(str(tmp_path / "a2"), {f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": -b},
                  rank=2, alpha=4, targets=["q_proj"])  # fmt: skip
    cache: dict = {}
    assert apply_adapter(model, str(tmp_path / "a1"), cache) == 1
    w = model.model.layers[0].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(w, w0 + 2.0 * b @ a)
    apply_adapter(model, str(tmp_path / "a2"), cache)
    torch.testing.assert_close(
        model.model.layers[0].self_attn.q_proj.weight.detach(), w0 - 2.0 * b @ a
    )
    tensors, scale = read_adapter(str(tmp_path / "a1"))
    assert scale == 2.0 and list(adapter_deltas(tensors, scale)) == [
        "model.layers.0.self_attn.q_proj.weight"
    ]


def test_lora_sync_hook_sends_adapter_under_versioned_names():
    from areal.api.io_struct import WeightUpdateMeta
    from areal.infra.weight_sync import WeightSyncContext

    hook = LoRASyncHook(lora_name="pol")
    meta = WeightUpdateMeta(type="disk", path="/x/v3", version=3)
    ctx = WeightSyncContext(version=3, previous_version=2, meta=meta, reason="step", actor=None,
                            rollout=None)  # fmt: skip
    out = hook.transform(ctx, meta)
    assert out.use_lora and out.lora_name == "pol-v3" and out.path == "/x/v3"
    first = LoRASyncHook(full_first=True)
    assert not first.transform(ctx, meta).use_lora
    assert first.transform(dataclasses.replace(ctx, version=4), meta).lora_name == "areal-lora-v4"


def test_vllm_backend_loads_adapter_with_v1_load_lora_adapter(tmp_path):
    """Request format only: not run against a real vLLM server here."""
    from areal.inference.clients.vllm import VLLMBackend
    from areal.infra.remote_inf_engine import GenParams
    from areal.models.lora_adapter import write_adapter

    def params():
        return GenParams(2, 0, 1.0, 1.0, -1, False, [], False)

    be = VLLMBackend()
    d = tmp_path / "v5"
    write_adapter(str(d), {"base_model.model.m.q_proj.lora_A.weight": torch.zeros(1, 2),
                           "base_model.model.m.q_proj.lora_B.weight": torch.zeros(2, 1)},
                  rank=1, alpha=1, targets=["q_proj"])  # fmt: skip
    call = be.update_disk_call(str(d), 5)
    assert call.path == "/v1/load_lora_adapter"
    assert call.payload == {"lora_name": "areal-lora-v5", "lora_path": str(d)}
    gen = be.generate_call("r1", [1, 2], params())
    assert gen.payload["model"] == "areal-lora-v5"
    full = be.update_disk_call(str(tmp_path), 6)  # a full HF directory: in-place reload
    assert full.path == "/collective_rpc"
    assert "model" not in be.generate_call("r2", [1], params()).payload


@pytest.mark.slow
def test_adapter_only_sync_server_logprobs_equal_trainer_merged_model(
    lora_engine, tiny_model_dir, tmp_path
):
    from _local_engine import local_engine

    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest, WeightUpdateMeta

    prompt = [5, 17, 33, 101, 7, 250]

    def server_vs_trainer(inf):
        req = ModelRequest(
            input_ids=prompt, gconfig=GenerationHyperparameters(max_new_tokens=10, greedy=True)
        )
        resp = asyncio.run(inf.agenerate(req))
        ids = torch.tensor([prompt + resp.output_tokens])
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}
        mine = lora_engine.forward_batch(batch)[0, len(prompt) :]
        return torch.tensor(resp.output_logprobs), mine

    with local_engine(tiny_model_dir) as inf:
        base = WeightUpdateMeta(type="disk", path=str(tmp_path / "wu"))
        lora_engine.connect_engine(inf, base)
        for version in (1, 2):
            for s in range(3):
                lora_engine.train_batch(_batch(10 * version + s), _nll, _weight)
            served, mine = server_vs_trainer(inf)
            if version == 1:
                assert (served - mine).abs().max() > 1e-3  # server still has the base
            meta = dataclasses.replace(
                base.with_version(version), use_lora=True, lora_name=f"p-v{version}"
            )
            lora_engine.update_weights(meta)
            files = sorted(os.listdir(meta.path))
            assert files == ["adapter_config.json", "adapter_model.safetensors"]
            served, mine = server_vs_trainer(inf)
            torch.testing.assert_close(served, mine, atol=1e-4, rtol=0)
