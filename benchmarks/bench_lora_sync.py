"""Bytes and seconds of one disk weight sync, full weights vs LoRA adapter only, on a
~100M-parameter Qwen2 (random weights), printed as one JSON object.

Each sync is what ``FSDPEngine.update_weights`` (disk) does on the trainer, then what the
built-in server does with it:

- full: gather + safetensors write of every weight (merged, for a LoRA model), then
  ``load_weights_from_disk`` into a serving copy of the model;
- adapter: gather + write of ``lora_A`` / ``lora_B`` only (+ ``adapter_config.json``),
  then ``apply_adapter`` (``W = W0 + s * B @ A``) into the serving copy.

Single process (FSDP2 world size 1, gloo), one torch thread.

Usage: ``.venv/bin/python benchmarks/bench_lora_sync.py [--rank 16] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch


def build_model(path: str) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
    from areal.engine.fsdp import FSDPEngine
    from areal.inference.server.weights import load_weights_from_disk
    from areal.models.lora_adapter import apply_adapter

    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    try:
        base = os.path.join(tmp, "base")
        n_params = build_model(base)
        serving = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        cfg = TrainEngineConfig(
            experiment_name="b",
            trial_name="b",
            path=base,
            dtype="float32",
            attn_impl="sdpa",
            optimizer=OptimizerConfig(lr=1e-4),
            use_lora=True,
            lora_rank=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        )
        eng = FSDPEngine(cfg)
        eng.create_process_group()
        eng.initialize(None, FinetuneSpec(1, 10, 1))
        n_lora = sum(p.numel() for p in eng.model.parameters() if p.requires_grad)
        results: dict[str, dict[str, list[float]]] = {}
        cache: dict[str, torch.Tensor] = {}
        for mode in ("full", "adapter"):
            rows: dict[str, list[float]] = {"push_s": [], "apply_s": [], "bytes": []}
            for i in range(args.repeats):
                path = os.path.join(tmp, f"{mode}-v{i}")
                meta = WeightUpdateMeta(
                    type="disk", path=path, version=i + 1, use_lora=mode == "adapter"
                )
                t0 = time.perf_counter()
                eng.update_weights(meta)
                rows["push_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if mode == "full":
                    load_weights_from_disk(serving, path)
                else:
                    apply_adapter(serving, path, cache)
                rows["apply_s"].append(time.perf_counter() - t0)
                rows["bytes"].append(float(dir_bytes(path)))
                shutil.rmtree(path)
            results[mode] = rows
        eng.destroy()

        def med(xs):
            return statistics.median(xs)

        out = {
            "model_params": n_params,
            "lora_rank": args.rank,
            "lora_trainable_params": n_lora,
            "repeats": args.repeats,
        }
        for mode, rows in results.items():
            out[mode] = {
                "bytes": int(med(rows["bytes"])),
                "push_seconds": round(med(rows["push_s"]), 4),
                "server_apply_seconds": round(med(rows["apply_s"]), 4),
                "total_seconds": round(med(rows["push_s"]) + med(rows["apply_s"]), 4),
            }
        out["bytes_ratio_full_over_adapter"] = round(
            out["full"]["bytes"] / max(out["adapter"]["bytes"], 1), 1
        )
        out["seconds_ratio_full_over_adapter"] = round(
            out["full"]["total_seconds"] / max(out["adapter"]["total_seconds"], 1e-9), 1
        )
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
