"""Training stall per recover checkpoint, synchronous vs asynchronous DCP saves.

One FSDP rank (gloo, CPU) trains a random Qwen2 of the ``30m`` shape of
``bench_planner.py`` (~30M parameters, fp32: ~0.36 GB of model + Adam state) for
``--steps`` steps and writes a recover checkpoint every ``--interval`` steps through
``RecoverHandler``, once with ``recover.save_mode=sync`` and once with ``async``, same
model, seed and batches. The stall of a checkpoint is the time ``dump`` keeps training
waiting (sync: the whole write; async: staging the state to CPU memory, plus any wait for
the previous write). Printed as one JSON object.

Usage: ``nice -n 10 .venv/bin/python benchmarks/bench_async_checkpoint.py [--steps 8]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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


def build_model(path: str) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPE_30M, max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def batch(step: int, b: int = 4, t: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, SHAPE_30M["vocab_size"], (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, :16] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def loss_fn(logp, _entropy, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum()


def loss_weight_fn(d):
    return d["loss_mask"].sum()


def run(model: str, root: str, mode: str, steps: int, interval: int) -> dict:
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, RecoverConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec, StepInfo
    from areal.engine.fsdp import FSDPEngine
    from areal.utils.recover import RecoverHandler, list_complete_checkpoints

    shutil.rmtree(root, ignore_errors=True)
    ft = FinetuneSpec(total_train_epochs=1, dataset_size=1000 * 4, train_batch_size=4)
    eng = FSDPEngine(
        TrainEngineConfig(
            experiment_name="bench",
            trial_name=mode,
            path=model,
            dtype="float32",
            optimizer=OptimizerConfig(lr=1e-4, warmup_steps_proportion=0.0),
            mb_spec=MicroBatchSpec(),
            num_threads=1,
        )
    )
    eng.create_process_group()
    eng.initialize(None, ft)
    cfg = RecoverConfig(
        experiment_name="bench",
        trial_name=mode,
        fileroot=root,
        mode="on",
        freq_steps=interval,
        save_mode=mode,
    )
    handler = RecoverHandler(cfg, ft)
    eng.train_batch(batch(10_000), loss_fn, loss_weight_fn)  # warm-up, not timed
    stalls, step_times = [], []
    t_run = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        eng.train_batch(batch(step), loss_fn, loss_weight_fn)
        step_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dumped = handler.dump(eng, StepInfo(0, step, step, ft.steps_per_epoch), *[None] * 4)
        if dumped is not None:
            stalls.append(time.perf_counter() - t0)
    t_loop = time.perf_counter() - t_run
    t0 = time.perf_counter()
    handler.close()  # shutdown waits for the last background write
    close_wait = time.perf_counter() - t0
    n_complete = len(list_complete_checkpoints(handler.root))
    eng.destroy()
    return {
        "checkpoints": len(stalls),
        "stall_per_checkpoint_s": round(statistics.mean(stalls), 3),
        "stall_max_s": round(max(stalls), 3),
        "stalls_s": [round(s, 3) for s in stalls],
        "train_step_s": round(statistics.median(step_times), 3),
        "loop_wall_s": round(t_loop, 2),
        "shutdown_wait_s": round(close_wait, 3),
        "complete_checkpoints_kept": n_complete,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--mode", choices=["sync", "async"], help="one mode only (child run)")
    ap.add_argument("--model")
    ap.add_argument("--root")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.mode:  # one mode in this process (a fresh process per mode)
        print(json.dumps(run(args.model, args.root, args.mode, args.steps, args.interval)))
        return
    import subprocess

    tmp = tempfile.mkdtemp(prefix="bench_async_ckpt_")
    try:
        model = os.path.join(tmp, "model")
        n_params = build_model(model)
        out = {
            "model": "random Qwen2, bench_planner 30m shape",
            "params": n_params,
            "state_bytes_fp32_with_adam": n_params * 4 * 3,
            "steps": args.steps,
            "interval": args.interval,
        }
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for mode in ("sync", "async"):
            cmd = [sys.executable, __file__, "--mode", mode, "--model", model]
            cmd += ["--root", os.path.join(tmp, mode), "--steps", str(args.steps)]
            cmd += ["--interval", str(args.interval)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                sys.exit(f"{mode} run failed:\n{r.stderr[-3000:]}")
            out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        s, a = out["sync"]["stall_per_checkpoint_s"], out["async"]["stall_per_checkpoint_s"]
        out["stall_reduction_x"] = round(s / a, 2) if a > 0 else None
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
