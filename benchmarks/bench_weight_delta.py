"""Delta weight transfer against full syncs: bytes and seconds per optimizer step.

One FSDP rank (gloo, CPU) trains, with AdamW at ``--lr`` (default 5e-6) on random token
batches (real gradients), a random Llama of ~30M parameters (``30m``: the shape of
``bench_planner.py`` / ``bench_async_checkpoint.py``) and, when it is in the local
Hugging Face cache, the real ``HuggingFaceTB/SmolLM2-135M-Instruct`` (``smollm2``; skipped
with the reason printed otherwise: ``make real-model`` puts it there). A built-in server
holds the weights in bfloat16. After a first full sync (the base), every step is followed
by a delta sync through ``WeightSynchronizer`` + ``DeltaTransport`` with the verified
weight sync's ``WeightFingerprintHook`` (every tensor's row sums at every sync), then, for
comparison, by the full disk path on the same weights (``save`` + the server's load,
rolled back, not committed): its bytes and seconds (``full_sync_s``; compare with
``delta_export_load_s``, the delta's export + load; ``delta_sync_s`` is the whole sync:
pause, export, load, fingerprint check, commit). After each step the server's
fingerprints (every tensor in full) are compared with the trainer's weights cast to bf16.

Printed as one JSON object: per model, per step the delta's bytes, the same weights dense
in bf16, the full disk sync's bytes (what the full path writes: float32 on CPU), the
changed share, both syncs' seconds and whether the fingerprints were equal; over all steps
the bytes ratio (target: >= 5x fewer bytes than dense bf16 over 10 steps at 135M).

Usage: ``nice -n 10 .venv/bin/python benchmarks/bench_weight_delta.py [--steps 10]
[--sizes 30m,smollm2] [--lr 5e-6]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPE_30M = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=16384,
)
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def build_30m(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE_30M, max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def cached_smollm2() -> tuple[str | None, str]:
    """(snapshot directory, "") when SmolLM2-135M is in the local HF cache, else (None,
    why); never downloads."""
    from areal.utils.hf_utils import resolve_model_path

    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return resolve_model_path(SMOLLM2), ""
    except (FileNotFoundError, ValueError) as e:
        return None, f"{SMOLLM2} is not in the local Hugging Face cache ({str(e)[:200]})"
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def batch(step: int, vocab: int, b: int = 4, t: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, :16] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def loss_fn(logp, _entropy, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum()


def loss_weight_fn(d):
    return d["loss_mask"].sum()


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(r, f))
        for r, _, files in os.walk(path)
        for f in files
        if f.endswith(".safetensors")
    )


def _fingerprints_equal(eng, engine, seed: int) -> bool:
    """Every tensor's full fingerprint: the server's against the trainer's weights cast to
    bf16 (exact sample, row sums within the fingerprint's tolerance)."""
    import requests

    from areal.infra.weights.fingerprint import compare_fingerprints
    from areal.utils.auth import auth_headers, get_run_secret

    r = requests.post(
        f"http://{engine.addresses[0]}/weights_fingerprint",
        json={"seed": seed},
        headers=auth_headers(get_run_secret()),
        timeout=600,
    )
    r.raise_for_status()
    server = r.json()["fingerprints"]
    names = list(server)  # by checkpoint name, tied aliases left out (as exported)
    trainer = eng.weights_fingerprint(seed, dict.fromkeys(names, "bfloat16"), names)
    return not compare_fingerprints(trainer, server)


def run(model: str, root: str, steps: int, lr: float) -> dict:
    from areal.api.cli_args import (
        InferenceEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
    from areal.engine.fsdp import FSDPEngine
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.infra.weights.weight_sync import WeightSynchronizer
    from areal.infra.weights.weight_verify import WeightFingerprintHook

    shutil.rmtree(root, ignore_errors=True)
    ft = FinetuneSpec(total_train_epochs=1, dataset_size=1000 * 4, train_batch_size=4)
    eng = FSDPEngine(
        TrainEngineConfig(
            experiment_name="bench",
            trial_name="delta",
            path=model,
            dtype="float32",
            optimizer=OptimizerConfig(lr=lr, warmup_steps_proportion=0.0, weight_decay=0.01),
            mb_spec=MicroBatchSpec(),
            num_threads=1,
        )
    )
    eng.create_process_group()
    eng.initialize(None, ft)
    vocab = eng.model_config.vocab_size
    n_params = sum(p.numel() for p in eng.model.parameters())
    server = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=600, request_timeout=600))
    try:
        server.launch_server({"model_path": model, "dtype": "bfloat16"})
        server.initialize(train_data_parallel_size=1)
        meta = WeightUpdateMeta.from_disk("bench", "delta", root)
        meta.delta, meta.delta_dtype = True, "bfloat16"
        sync = WeightSynchronizer(eng, server, meta, hooks=[WeightFingerprintHook(full_every=1)])
        first = sync.sync(1)
        assert first["weight_sync/delta"] == 0.0, first
        rows = []
        for step in range(steps):
            t0 = time.perf_counter()
            eng.train_batch(batch(step, vocab), loss_fn, loss_weight_fn)
            train_s = time.perf_counter() - t0
            version = step + 2
            s = sync.sync(version)
            if s.get("weight_sync/refused") or s.get("weight_sync/delta") != 1.0:
                raise RuntimeError(f"step {step}: the delta sync was not a committed delta: {s}")
            # the full path on the same weights, for comparison: save + load, rolled back
            full_dir = os.path.join(root, "full", f"v{version}")
            t0 = time.perf_counter()
            eng.save(SaveLoadMeta(path=full_dir, weight_format="hf", with_optim=False))
            full_meta = WeightUpdateMeta(type="disk", path=full_dir, version=10_000 + version)
            server.update_weights_from_disk(full_meta).result()
            full_s = time.perf_counter() - t0
            server.rollback_weights(None)
            full_bytes = _dir_bytes(full_dir)
            shutil.rmtree(full_dir, ignore_errors=True)
            rows.append(
                {
                    "step": step,
                    "delta_bytes": int(s["weight_sync/delta_bytes"]),
                    "dense_bf16_bytes": int(s["weight_sync/delta_dense_bytes"]),
                    "full_disk_bytes": full_bytes,
                    "changed_fraction": round(s["weight_sync/delta_changed_fraction"], 5),
                    "ratio_vs_dense_bf16": round(
                        s["weight_sync/delta_dense_bytes"] / max(s["weight_sync/delta_bytes"], 1),
                        2,
                    ),
                    "delta_sync_s": round(s["weight_sync/seconds"], 3),
                    "delta_export_s": round(s["weight_sync/export_seconds"], 3),
                    # export + the servers' load: the part the full path's figure covers
                    "delta_export_load_s": round(s["weight_sync/push_seconds"], 3),
                    "full_sync_s": round(full_s, 3),
                    "train_step_s": round(train_s, 3),
                    "verified": s.get("weight_sync/fingerprint_servers") == 1.0,
                    "fingerprint_equal": _fingerprints_equal(eng, server, 1000 + step),
                }
            )
        delta_total = sum(r["delta_bytes"] for r in rows)
        dense_total = sum(r["dense_bf16_bytes"] for r in rows)
        full_total = sum(r["full_disk_bytes"] for r in rows)
        return {
            "model": model,
            "params": n_params,
            "lr": lr,
            "steps": rows,
            "delta_bytes_total": delta_total,
            "dense_bf16_bytes_total": dense_total,
            "full_disk_bytes_total": full_total,
            "ratio_vs_dense_bf16": round(dense_total / max(delta_total, 1), 2),
            "ratio_vs_full_disk": round(full_total / max(delta_total, 1), 2),
            "delta_sync_s_median": round(statistics.median(r["delta_sync_s"] for r in rows), 3),
            "delta_export_load_s_median": round(
                statistics.median(r["delta_export_load_s"] for r in rows), 3
            ),
            "full_sync_s_median": round(statistics.median(r["full_sync_s"] for r in rows), 3),
            "all_fingerprints_equal": all(r["fingerprint_equal"] for r in rows),
            "all_verified": all(r["verified"] for r in rows),
        }
    finally:
        server.destroy()
        server.teardown_server()
        eng.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--sizes", default="30m,smollm2", help="comma-separated: 30m, smollm2")
    ap.add_argument("--model", help="(child run) model directory")
    ap.add_argument("--root", help="(child run) weight-update root")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.model:  # one model in this process (a fresh process per model)
        print(json.dumps(run(args.model, args.root, args.steps, args.lr)))
        return
    tmp = tempfile.mkdtemp(prefix="bench_weight_delta_")
    out: dict = {"steps": args.steps, "lr": args.lr, "server_dtype": "bfloat16", "models": {}}
    try:
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            if size == "30m":
                model = build_30m(os.path.join(tmp, "30m"))
                label = "random Llama, 30m shape"
            elif size == "smollm2":
                model, why = cached_smollm2()
                if model is None:
                    print(f"skipping smollm2: {why}", file=sys.stderr)
                    out["models"]["smollm2"] = {"skipped": why}
                    continue
                label = SMOLLM2
            else:
                sys.exit(f"unknown size {size!r}; allowed: 30m, smollm2")
            cmd = [
                sys.executable,
                __file__,
                "--model",
                model,
                "--root",
                os.path.join(tmp, f"{size}-sync"),
            ]
            cmd += ["--steps", str(args.steps), "--lr", str(args.lr)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                sys.exit(f"{size} run failed:\n{r.stderr[-3000:]}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res["label"] = label
            if size == "smollm2":
                res["target_5x_met"] = res["ratio_vs_dense_bf16"] >= 5.0
            out["models"][size] = res
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
