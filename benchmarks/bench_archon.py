"""Benchmark of ArchonEngine layouts on CPU (gloo) against FSDPEngine at the same world
size, printed as one JSON object.

Per layout (``fsdp:d2`` as the reference, ``archon:d2``, ``archon:d1t2``,
``archon:d1c2``, ``archon:d1p2``; with ``--world 4`` also ``fsdp:d4``, ``archon:d2t2``,
``archon:d2c2``, ``archon:d2p2``; ``--family qwen3_moe``, a mixture-of-experts model
with ``--experts`` experts, top-2: ``fsdp:dN``, ``archon:dN``, ``archon:dNe2`` and with
``--world 4`` ``archon:d4e4`` and the hybrid ``archon:(attn:d2t2|ffn:d2e2)``;
``--layouts a,b``: only these, the first being the reference):

- ``step_s``: median wall time of one ``train_batch`` (AdamW, one micro-batch per rank,
  after one warm-up step), the same global batch for every layout;
- ``state_bytes_per_rank``: bytes this rank holds of parameters + gradients + optimizer
  states (local shards), and ``state_fraction`` of the whole (1/N when fully sharded);
- ``export_s``: time of ``export_weight_shards`` (each tensor gathered once, buckets
  written by the ranks in turn).

Usage: ``.venv/bin/python benchmarks/bench_archon.py [--world 2|4] [--steps 3]
[--hidden 256] [--layers 4] [--family qwen2|qwen3_moe] [--experts 8] [--layouts ...]``
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_model(path: str, hidden: int, layers: int, family: str = "qwen2", experts: int = 8):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            vocab_size=2048,
            hidden_size=hidden,
            intermediate_size=hidden * 3,
            moe_intermediate_size=hidden * 3 // 2,
            num_experts=experts,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=hidden // 8,
            max_position_embeddings=1024,
        )
        Qwen3MoeForCausalLM(cfg).save_pretrained(path)
        return
    cfg = Qwen2Config(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def _batch(rows: int, seqlen: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(seqlen // 2, seqlen + 1, (rows,), generator=g)
    ids = torch.randint(3, 2048, (rows, seqlen), generator=g)
    mask = (torch.arange(seqlen)[None] < lens[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask.clone()}


def _loss(logp, _ent, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum()


def _weight(d):
    return d["loss_mask"].sum()


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _checkpoint_numel(path: str) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                for k in st.keys():
                    n += math.prod(st.get_slice(k).get_shape())
    return n


def _worker(rank, world, port, path, backend, steps, rows, seqlen, q):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        torch.set_num_threads(1)
        from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
        from areal.api.io_struct import FinetuneSpec

        cfg = TrainEngineConfig(
            experiment_name="b", trial_name="b", path=path, dtype="float32", backend=backend,
            optimizer=OptimizerConfig(lr=1e-4), mb_spec=MicroBatchSpec(), num_threads=1,
        )  # fmt: skip
        if backend.startswith("archon"):
            from areal.engine.archon import ArchonEngine as cls
        else:
            from areal.engine.fsdp import FSDPEngine as cls
        eng = cls(cfg)
        eng.create_process_group()
        eng.initialize(None, FinetuneSpec(1, 100, 1))
        batch = _batch(rows, seqlen)
        dp, r = eng.data_parallel_world_size, eng.data_parallel_rank
        part = {k: v[r::dp] for k, v in batch.items()}
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            eng.train_batch(part, _loss, _weight)
            if i:
                times.append(time.perf_counter() - t0)
        params = list(eng.model.parameters())
        mine = sum(_local_bytes(p) for p in params) * 2  # parameters + gradients
        for st in eng.optimizer.state.values():
            mine += sum(_local_bytes(v) for v in st.values() if torch.is_tensor(v) and v.dim())
        # the whole model (every pipeline stage), fp32: parameters, gradients, 2 Adam moments
        whole = _checkpoint_numel(path) * 4 * 4
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            eng.export_weight_shards(d, shard_mb=16)
            export_s = time.perf_counter() - t0
        eng.destroy()
        res = dict(step_s=statistics.median(times), state_bytes_per_rank=mine,
                   state_fraction=mine / whole, export_s=export_s)  # fmt: skip
        buf = io.BytesIO()
        torch.save(res, buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "err", traceback.format_exc()))


def _run(world, path, backend, steps, rows, seqlen) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, path, backend, steps, rows, seqlen, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, status, payload = q.get(timeout=1800)
            if status != "ok":
                raise RuntimeError(f"{backend} rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    r0 = out[0]
    return {
        "step_s": round(max(o["step_s"] for o in out.values()), 4),
        "state_bytes_per_rank": [out[r]["state_bytes_per_rank"] for r in sorted(out)],
        "state_fraction": round(r0["state_fraction"], 4),
        "export_s": round(max(o["export_s"] for o in out.values()), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2, choices=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--family", default="qwen2", choices=["qwen2", "qwen3_moe"])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layouts", default="", help="comma-separated; the first is the reference")
    a = ap.parse_args()
    if a.family == "qwen3_moe":
        w = a.world
        layouts = [f"fsdp:d{w}", f"archon:d{w}", f"archon:d{w}e2"] + (
            ["archon:d4e4", "archon:(attn:d2t2|ffn:d2e2)"] if w == 4 else []
        )
    else:
        layouts = (
            ["fsdp:d2", "archon:d2", "archon:d1t2", "archon:d1c2", "archon:d1p2"]
            if a.world == 2
            else ["fsdp:d4", "archon:d4", "archon:d2t2", "archon:d2c2", "archon:d2p2"]
        )
    if a.layouts:
        layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model")
        _save_model(path, a.hidden, a.layers, a.family, a.experts)
        results = {b: _run(a.world, path, b, a.steps, a.rows, a.seqlen) for b in layouts}
    ref = results[layouts[0]]["step_s"]
    for b in layouts:
        results[b]["step_vs_fsdp"] = round(results[b]["step_s"] / ref, 3)
    report = {
        "world_size": a.world,
        "model": {"hidden": a.hidden, "layers": a.layers, "vocab": 2048, "family": a.family},
        "batch": {"rows": a.rows, "max_seqlen": a.seqlen},
        "device": "cpu (gloo), 1 torch thread per rank",
        "layouts": results,
    }
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
