"""Benchmark of FSDPEngine on CPU (gloo), printed as one JSON object.

1. Training throughput (real tokens/s) of packed micro-batching (FFD under a token
   budget, no padding) vs naive padded batching (same model, same number of
   micro-batches, every micro-batch padded to the batch's longest sequence), on a batch
   whose lengths follow GSM8K prompt + answer lengths (taken from the local GSM8K file
   when present, else a synthetic spread).
2. Weight export time of a ~100M-parameter Qwen2 from 2 FSDP ranks: ``disk`` (gather +
   safetensors write) and ``xccl`` over gloo (gather + broadcast to a receiver process).

Usage: ``.venv/bin/python benchmarks/bench_train_engine.py [--skip-export] [--skip-train]``
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback

import torch

GSM8K = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "train.jsonl"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lengths(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    if os.path.exists(GSM8K):
        with open(GSM8K) as f:
            rows = [json.loads(line) for line in f]
        # ~3.5 characters per BPE token; a short chat template adds ~20 tokens.
        lens = [20 + (len(r["question"]) + len(r["answer"])) * 2 // 7 for r in rng.sample(rows, n)]
        return [min(512, x) for x in lens]
    return [min(512, int(rng.lognormvariate(5.2, 0.35))) for _ in range(n)]


def _save_model(path: str, hidden: int, layers: int, inter: int, vocab: int, heads: int, kv: int):
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ).save_pretrained(path)
    return path


def _config(path: str, max_tokens: int | None, train: bool = True):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    return TrainEngineConfig(
        experiment_name="bench",
        trial_name="bench",
        path=path,
        init_from_scratch=True,
        dtype="float32",
        optimizer=OptimizerConfig(lr=1e-5, warmup_steps_proportion=0.0) if train else None,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
        num_threads=1,
    )


def _loss_fn(logp, _ent, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum()


def _weight_fn(d):
    return d["loss_mask"].sum()


def _padded_step(eng, batch, n_mbs: int) -> None:
    """Naive baseline: n_mbs equal micro-batches, each padded to the batch's longest row."""
    model = eng.model
    model.train()
    eng.optimizer_zero_grad()
    b = batch["input_ids"].shape[0]
    total = batch["loss_mask"].sum()
    chunks = torch.arange(b).chunk(n_mbs)
    for i, idx in enumerate(chunks):
        model.set_requires_gradient_sync(i == len(chunks) - 1)
        ids, mask, lm = (
            batch["input_ids"][idx],
            batch["attention_mask"][idx],
            batch["loss_mask"][idx],
        )
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        m = lm[:, 1:].float()
        loss = -(logp * m).sum() / total
        loss.backward()
    model.set_requires_gradient_sync(True)
    eng.optimizer_step()


def _train_bench(rank: int, out_dir: str, args) -> dict:
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp import FSDPEngine

    path = _save_model(os.path.join(out_dir, "small"), 256, 4, 688, 4000, 4, 2)
    lens = torch.tensor(_lengths(args.batch))
    t = int(lens.max())
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    ids = torch.randint(3, 4000, (args.batch, t), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[:, :60] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    n_tokens = int(lens.sum())
    eng = FSDPEngine(_config(path, args.max_tokens_per_mb))
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 100, 1))
    n_params = sum(p.numel() for p in eng.model.parameters())
    n_mbs = len(eng._split(batch))

    def timeit(fn):
        fn()  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    packed = timeit(lambda: eng.train_batch(batch, _loss_fn, _weight_fn))
    padded = timeit(lambda: _padded_step(eng, batch, n_mbs))
    eng.destroy()
    return {
        "model_params_M": round(n_params / 1e6, 2),
        "batch_size": args.batch,
        "real_tokens": n_tokens,
        "padded_tokens": args.batch * t,
        "seqlen_min_mean_max": [int(lens.min()), round(float(lens.float().mean()), 1), t],
        "max_tokens_per_mb": args.max_tokens_per_mb,
        "n_micro_batches": n_mbs,
        "packed_step_s": round(packed, 3),
        "padded_step_s": round(padded, 3),
        "packed_tokens_per_s": round(n_tokens / packed, 1),
        "padded_tokens_per_s": round(n_tokens / padded, 1),
        "speedup": round(padded / packed, 2),
    }


def _export_rank(rank: int, world_size: int, out_dir: str, wu_port: int, q_specs, q_ack) -> dict:
    import threading
    from concurrent.futures import Future

    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.fsdp import FSDPEngine

    path = os.path.join(out_dir, "big")
    eng = FSDPEngine(_config(path, None, train=False))
    eng.create_process_group()
    eng.initialize(None, None)
    n_params = sum(p.numel() for p in eng.model.parameters())

    class Fake:
        def update_weights_from_disk(self, meta):
            f = Future()
            f.set_result(None)
            return f

        def init_weights_update_group(self, meta):
            q_specs.put(("init", meta.master_port, meta.world_size, meta.group_name))
            f = Future()
            f.set_result(None)
            return f

        def update_weights_from_distributed(self, meta, specs):
            q_specs.put(("bucket", [s.to_dict() for s in specs]))
            f = Future()
            threading.Thread(target=lambda: f.set_result(q_ack.get()), daemon=True).start()
            return f

    if rank == 0:
        eng.connect_engine(Fake(), None)
    res = {"model_params_M": round(n_params / 1e6, 1)}
    disk_meta = WeightUpdateMeta(type="disk", path=os.path.join(out_dir, "wu_disk"))
    times = []
    for _ in range(2):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng._update_weights_from_disk(disk_meta)
        times.append(time.perf_counter() - t0)
    res["disk_export_s"] = round(min(times), 3)
    xmeta = WeightUpdateMeta(
        type="xccl", master_port=wu_port, world_size=2, weight_chunked_mem_mb=256
    )
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.update_weights(xmeta)  # includes joining the group
    res["xccl_first_export_s"] = round(time.perf_counter() - t0, 3)
    times = []
    for _ in range(2):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng.update_weights(xmeta)
        times.append(time.perf_counter() - t0)
    res["xccl_export_s"] = round(min(times), 3)
    if rank == 0:
        q_specs.put(("done",))
    eng.destroy()
    return res


def _receiver(q_specs, q_ack) -> dict:
    from areal.api.io_struct import ParamSpec
    from areal.utils.dist import broadcast_tensor, init_custom_process_group

    _, port, world_size, name = q_specs.get()
    pg = init_custom_process_group("gloo", "127.0.0.1", port, world_size, 1, name)
    n = 0
    while True:
        msg = q_specs.get()
        if msg[0] == "done":
            return {"tensors_received": n}
        for d in msg[1]:
            s = ParamSpec.from_dict(d)
            broadcast_tensor(pg, torch.empty(s.shape, dtype=getattr(torch, s.dtype)), 0)
            n += 1
        q_ack.put(len(msg[1]))


def _entry(tag, fn, env, args, q):
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        q.put((tag, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001
        q.put((tag, "err", traceback.format_exc()))


def _run(jobs: list[tuple], world_size: int, timeout: float = 900) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = []
    try:
        for tag, fn, args, is_rank in jobs:
            env = {}
            if is_rank:
                env = {
                    "RANK": str(tag),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(tag),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            p = ctx.Process(target=_entry, args=(tag, fn, env, args, q), daemon=True)
            p.start()
            procs.append(p)
        out = {}
        while len(out) < len(jobs):
            tag, status, res = q.get(timeout=timeout)
            if status == "err":
                raise RuntimeError(f"{tag} failed:\n{res}")
            out[tag] = torch.load(io.BytesIO(res), weights_only=False)
        return out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens-per-mb", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-export", action="store_true")
    args = ap.parse_args(argv)
    result = {"torch_threads_per_rank": 1, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_train:
            result["train"] = _run([(0, _train_bench, (0, tmp, args), True)], 1)[0]
        if not args.skip_export:
            # ~100M params: hidden 768, 12 layers, MLP 2048, vocab 32000 (tied embeddings)
            _save_model(os.path.join(tmp, "big"), 768, 12, 2048, 32000, 12, 4)
            ctx = mp.get_context("spawn")
            qs, qa = ctx.Queue(), ctx.Queue()
            wu_port = _free_port()
            out = _run(
                [
                    (0, _export_rank, (0, 2, tmp, wu_port, qs, qa), True),
                    (1, _export_rank, (1, 2, tmp, wu_port, qs, qa), True),
                    ("recv", _receiver, (qs, qa), False),
                ],
                2,
            )
            result["export"] = dict(out[0], world_size=2, **out["recv"])
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
