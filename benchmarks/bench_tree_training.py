"""Tree training (``actor.enable_tree_training``) against today's path, one JSON object.

The trainer's ``train_batch`` step time (FSDPEngine, one CPU rank, fp32, the shipped
tiny-base model, a GRPO loss) with tree training vs today's path (the one-level shared
prefix plan, ``share_prefixes=True``), on three batches:

- ``agent``: multi-call agent exports, one row per model call (4 calls per episode,
  ``n_samples=4`` episodes per prompt, 4 prompts): each row is the whole history so far
  (system + task prompt, earlier completions and tool results) plus the new completion;
- ``dpo``: preference pairs, chosen and rejected sharing their prompt;
- ``grpo``: the demo's batch shape (16 prompts x 8 samples, short prompts, <= 48 new
  tokens), which must not be slower.

The two paths run interleaved (``--repeats`` rounds, each one step of each after a
warm-up step, the first of the two alternating); the figures are the median step time,
the ratio tree / today of the medians and that of the fastest steps.

Usage: ``.venv/bin/python benchmarks/bench_tree_training.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _rng_rows(g: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=g)


def _len(g: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def agent_rows(vocab: int, prompts: int = 4, n_samples: int = 4, calls: int = 4):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(prompts):
        prompt = _rng_rows(g, _len(g, 150, 250), vocab)  # system + tools + task
        for _ in range(n_samples):
            hist = prompt
            for _ in range(calls):
                row = torch.cat([hist, _rng_rows(g, _len(g, 30, 80), vocab)])  # completion
                rows.append(row)
                hist = torch.cat([row, _rng_rows(g, _len(g, 20, 60), vocab)])  # tool result
    return rows


def dpo_rows(vocab: int, pairs: int = 32):
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(pairs):
        prompt = _rng_rows(g, _len(g, 150, 300), vocab)
        rows += [torch.cat([prompt, _rng_rows(g, _len(g, 40, 120), vocab)]) for _ in range(2)]
    return rows


def grpo_rows(vocab: int, prompts: int = 16, n: int = 8):
    g = torch.Generator().manual_seed(2)
    rows = []
    for _ in range(prompts):
        prompt = _rng_rows(g, _len(g, 20, 40), vocab)
        rows += [torch.cat([prompt, _rng_rows(g, _len(g, 8, 48), vocab)]) for _ in range(n)]
    return rows


def batch_of(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    b, t = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = True
    g = torch.Generator().manual_seed(3)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": mask.clone(),
        "old_logp": -torch.rand(b, t, generator=g) * mask,
        "advantages": torch.randn(b, t, generator=g) * mask,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens-per-mb", type=int, default=8192)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import functools

    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp import FSDPEngine
    from areal.models.tiny import get_tiny_base_path
    from areal.trainer.ppo.actor import grpo_loss_fn, loss_weight

    path = get_tiny_base_path()
    cfg = TrainEngineConfig(
        experiment_name="bench", trial_name="tree", path=path, dtype="float32", num_threads=1,
        optimizer=OptimizerConfig(lr=1e-6), mb_spec=MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb),
    )  # fmt: skip
    eng = FSDPEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 1000, 1))
    vocab = int(eng.model_config.vocab_size)
    loss = functools.partial(grpo_loss_fn, eps_clip=0.2)
    result: dict = {"model": os.path.basename(path), "repeats": args.repeats, "workloads": {}}
    workloads = {
        "agent": (agent_rows(vocab), 1),
        "dpo": (dpo_rows(vocab), 2),
        "grpo_demo": (grpo_rows(vocab), 1),
    }
    for name, (rows, gran) in workloads.items():
        batch = batch_of(rows)
        cfg.mb_spec.granularity = gran
        times: dict[str, list[float]] = {"today": [], "tree": []}
        for r in range(args.repeats + 1):
            # alternate which path runs first in a round (the second one found the
            # allocator and caches in the first one's state)
            for mode in ("today", "tree") if r % 2 else ("tree", "today"):
                cfg.enable_tree_training = mode == "tree"
                t0 = time.perf_counter()
                eng.train_batch(batch, loss, loss_weight)
                if r:  # round 0 warms up both paths
                    times[mode].append(time.perf_counter() - t0)
        cfg.enable_tree_training = True
        mbs = list(eng._split(batch).packed())
        stored = 0
        for mb in mbs:
            plan = eng._shared_prefix_plan(mb["input_ids"], mb["cu_seqlens"])
            stored += int(mb["input_ids"].numel()) if plan is None else plan.n_tokens
        med = {k: statistics.median(v) for k, v in times.items()}
        result["workloads"][name] = {
            "rows": len(rows),
            "tokens": int(batch["attention_mask"].sum()),
            "tree_stored_tokens": stored,
            "tree_micro_batches": len(mbs),
            "step_s_today": round(med["today"], 4),
            "step_s_tree": round(med["tree"], 4),
            "step_s_today_all": [round(x, 4) for x in times["today"]],
            "step_s_tree_all": [round(x, 4) for x in times["tree"]],
            "tree_over_today": round(med["tree"] / med["today"], 3),
            # the fastest step of each: the least disturbed by other load on the machine
            "tree_over_today_min": round(min(times["tree"]) / min(times["today"]), 3),
        }
    eng.destroy()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
