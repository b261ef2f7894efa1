"""Per-step seconds of ``compute_logp`` and ``train_step`` (``ppo_update``) of the actor on
the CPU examples' batches, old code path vs new, printed as one JSON object.

1. ``vlm``: the VLM example's batch (``examples/vlm/clevr_count_grpo_cpu.yaml``: 16 prompts
   x 8 samples of ``synthetic://clevr`` scenes on ``areal/models/assets/tiny-vlm``, each
   sample its own processor output, completions ``[k]`` + EOS as the model writes them);
2. ``mt``: the multi-turn example's batch (``examples/multi_turn_math/gsm8k_grpo_mt_cpu.yaml``:
   16 prompts x 8 samples on ``tiny-base``; 60% of the samples take a second turn after the
   feedback message, lengths as measured in that run: 56-294 tokens).

Each batch runs on one ``FSDPPPOActor`` (1-rank gloo, one torch thread, the example's actor
config) as the trainer runs it: ``compute_logp`` (prox logprobs), ``compute_advantages``,
``ppo_update``. ``old`` is the code path before this benchmark's changes, selected by the
engine's switches: VLM ``engine.dedup_images = False`` and ``engine.share_prefixes = False``
(every sample's image copy through the vision tower, every sequence's tokens on their own,
M-RoPE positions per sequence), text ``attention.MEMBER_BUCKET_RATIO = 0`` (the members of
shared-prefix groups in one padded attention call); ``new`` the defaults. Both start from
the same weights; the first step of each is a warm-up and is not counted.

Usage: ``.venv/bin/python benchmarks/bench_vlm_step.py [--which vlm,mt] [--steps 3]
[--profile old|new]`` (``--profile``: cProfile of that path's timed steps, to stderr).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import time
from typing import Any

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VLM_YAML = os.path.join(ROOT, "examples/vlm/clevr_count_grpo_cpu.yaml")
MT_YAML = os.path.join(ROOT, "examples/multi_turn_math/gsm8k_grpo_mt_cpu.yaml")
MT_SCRIPT = os.path.join(ROOT, "examples/multi_turn_math/gsm8k_rl_mt.py")
BUCKET_RATIO = 0.75  # attention.MEMBER_BUCKET_RATIO of the new path


def _actor_config(yaml_path: str):
    import importlib.util

    from areal.api.cli_args import GRPOConfig, load_expr_config

    cls = GRPOConfig
    if yaml_path == MT_YAML:  # the multi-turn example's own config class (extra fields)
        spec = importlib.util.spec_from_file_location("gsm8k_rl_mt", MT_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cls = module.MultiTurnGRPOConfig
    config, _ = load_expr_config(["--config", yaml_path], cls)
    actor = config.actor
    actor.path = os.path.join(ROOT, actor.path)
    return actor, config


def _padded(seqs: list[tuple[list[int], list[int]]], rng: random.Random) -> dict:
    width = max(len(p) + len(a) for p, a in seqs)
    b = len(seqs)
    ids = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.long)
    logprobs = torch.zeros((b, width))
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        loss_mask[i, len(p) : n] = 1
        logprobs[i, len(p) : n] = torch.tensor([-rng.uniform(0.05, 2.0) for _ in a])
        versions[i, len(p) : n] = 0
    rewards = torch.tensor([float(rng.random() < 0.4) for _ in seqs])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "versions": versions,
        "rewards": rewards,
        "seqlen": mask.sum(1),
    }


def _rows(config, n: int) -> tuple[list[dict], Any, Any]:
    """The first ``n`` rows of the example's training set."""
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer
    from areal.utils.vlm import load_vlm_processor

    tok = load_hf_tokenizer(config.actor.path)
    proc = (
        load_vlm_processor(config.actor.path, tokenizer=tok)
        if "clevr" in str(config.train_dataset.path)
        else None
    )
    ds = get_custom_dataset("train", config.train_dataset, tok, proc)
    return [ds[i] for i in range(n)], tok, proc


def vlm_batch(config, n_prompts: int = 16, n_samples: int = 8, seed: int = 0) -> dict:
    """The VLM example's step batch (see the module docstring)."""
    from areal.utils.vlm import load_images

    rows, tok, proc = _rows(config, n_prompts)
    rng = random.Random(seed)
    seqs, entries = [], []
    for r in rows:
        text = proc.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        for _ in range(n_samples):  # one processor call per sample, as the workflow does
            enc = proc(text=[text], images=load_images(r["images"]), return_tensors="pt")
            ans = tok.encode(f"[{rng.randint(0, 5)}]", add_special_tokens=False)
            seqs.append((enc["input_ids"][0].tolist(), ans + [tok.eos_token_id]))
            entries.append(
                {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
            )
    batch = _padded(seqs, rng)
    batch["multi_modal_input"] = entries
    return batch


def mt_batch(config, n_prompts: int = 16, n_samples: int = 8, seed: int = 0) -> dict:
    """The multi-turn example's step batch (see the module docstring)."""
    from areal.workflow.multi_turn import feedback_prompt_ids

    rows, tok, _ = _rows(config, n_prompts)
    feedback = feedback_prompt_ids(tok)
    rng = random.Random(seed)
    vocab = [t for t in range(4, len(tok)) if t != tok.eos_token_id]
    seqs = []
    for r in rows:
        out = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
        prompt = [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]
        for _ in range(n_samples):
            ans1 = [rng.choice(vocab) for _ in range(rng.randint(14, 48))] + [tok.eos_token_id]
            if rng.random() < 0.4:  # right the first time: one turn
                seqs.append((prompt, ans1))
                continue
            ans2 = [rng.choice(vocab) for _ in range(rng.randint(40, 48))] + [tok.eos_token_id]
            # the feedback turn is scored like the answers here (the cost is what counts)
            seqs.append((prompt, ans1 + feedback + ans2))
    return _padded(seqs, rng)


def _actor(actor_cfg):
    from areal.api.io_struct import FinetuneSpec
    from areal.trainer.ppo.actor import FSDPPPOActor

    actor = FSDPPPOActor(actor_cfg)
    actor.create_process_group()
    actor.initialize(None, FinetuneSpec(1, 1000, 16), seed=1)
    return actor


def _one_step(actor, batch: dict) -> tuple[float, float]:
    data = dict(batch)
    t0 = time.perf_counter()
    data["prox_logp"] = actor.compute_logp(data)
    t1 = time.perf_counter()
    data = actor.compute_advantages(data)
    t2 = time.perf_counter()
    actor.ppo_update(data)
    actor.step_lr_scheduler()
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def _set_path(actor, which: str, mode: str) -> None:
    """``old``: the code path before the fast paths (see the module docstring)."""
    from areal.engine.fsdp import attention

    fast = mode == "new"
    if which == "vlm":  # old: every image copy through the tower, no prefix sharing
        actor.dedup_images = fast
        actor.share_prefixes = fast
    else:  # old: shared prefixes with all members in one padded attention call
        actor.share_prefixes = True
    attention.MEMBER_BUCKET_RATIO = BUCKET_RATIO if fast else 0.0


def bench(which: str, steps: int, profile: str) -> dict:
    yaml_path = VLM_YAML if which == "vlm" else MT_YAML
    actor_cfg, config = _actor_config(yaml_path)
    batch = (vlm_batch if which == "vlm" else mt_batch)(config)
    n_tokens = int(batch["attention_mask"].sum())
    actor = _actor(actor_cfg)
    state = {k: v.clone() for k, v in actor.model.state_dict().items()}
    opt_state = actor.optimizer.state_dict()
    out: dict = {"n_seqs": int(batch["attention_mask"].shape[0]), "n_tokens": n_tokens}
    for mode in ("old", "new"):
        actor.model.load_state_dict(state)
        actor.optimizer.load_state_dict(opt_state)
        _set_path(actor, which, mode)
        _one_step(actor, batch)  # warm-up
        prof = cProfile.Profile() if profile == mode else None
        logp, train = [], []
        for _ in range(steps):
            if prof is not None:
                prof.enable()
            a, b = _one_step(actor, batch)
            if prof is not None:
                prof.disable()
            logp.append(a)
            train.append(b)
        out[mode] = {
            "compute_logp_s": round(sum(logp) / steps, 3),
            "train_step_s": round(sum(train) / steps, 3),
            "train_tokens_per_s": round(n_tokens / (sum(train) / steps)),
        }
        if prof is not None:
            st = pstats.Stats(prof, stream=sys.stderr)
            st.sort_stats("cumulative").print_stats(45)
            st.sort_stats("tottime").print_stats(25)
    out["speedup_compute_logp"] = round(
        out["old"]["compute_logp_s"] / out["new"]["compute_logp_s"], 2
    )
    out["speedup_train_step"] = round(out["old"]["train_step_s"] / out["new"]["train_step_s"], 2)
    actor.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--which", default="vlm,mt")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", default="", choices=["", "old", "new"], help="cProfile a path")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {}
    for which in args.which.split(","):
        result[which] = bench(which, args.steps, args.profile)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
