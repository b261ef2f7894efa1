"""Forward+backward time of a log-probability loss on packed prefix tries
(areal.utils.prefix_tree) against the flat padded batch, on the shipped tiny Qwen2 (CPU,
fp32, one thread). Workloads: agent episodes (4 calls over a growing history, n_samples=4
episodes per prompt) and DPO pairs sharing the prompt. Prints JSON."""

from __future__ import annotations

import json
import random
import time

import torch
from transformers import AutoModelForCausalLM

from areal.models.tiny import get_tiny_base_path
from areal.utils.prefix_tree import pack_prefix_trees, tree_forward_logprobs

VOCAB = 384


def _rand(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


def agent(rng, prompts=2, n_samples=4, calls=4):
    out = []
    for _ in range(prompts):
        prompt = _rand(rng, 96)
        for _ in range(n_samples):
            hist = list(prompt)
            for _ in range(calls):
                hist = hist + _rand(rng, 32)
                out.append(list(hist))
    return out


def dpo(rng, pairs=8):
    out = []
    for _ in range(pairs):
        prompt = _rand(rng, 128)
        out += [prompt + _rand(rng, 48), prompt + _rand(rng, 48)]
    return out


def flat_logprobs(model, seqs):
    length = max(map(len, seqs))
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    att = torch.zeros(len(seqs), length, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        att[b, : len(s)] = 1
    logp = model(input_ids=ids, attention_mask=att).logits.float().log_softmax(-1)
    return [
        logp[b, : len(s) - 1].gather(-1, ids[b, 1 : len(s), None])[:, 0] for b, s in enumerate(seqs)
    ]


def timed(model, fn, seqs, reps=3):
    best = float("inf")
    for _ in range(reps):
        model.zero_grad()
        t = time.perf_counter()
        loss = sum(lp.sum() for lp in fn(model, seqs))
        loss.backward()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        get_tiny_base_path(), attn_implementation="sdpa", dtype=torch.float32
    )
    rng = random.Random(0)
    report = {}
    for name, seqs in (("agent_4calls_n4", agent(rng)), ("dpo_pairs", dpo(rng))):
        flat_s = timed(model, flat_logprobs, seqs)
        tree_s = timed(model, tree_forward_logprobs, seqs)
        report[name] = {
            "sequences": len(seqs),
            "flat_tokens": sum(map(len, seqs)),
            "tree_tokens": sum(p.n_tokens for p in pack_prefix_trees(seqs)),
            "flat_fwd_bwd_s": round(flat_s, 4),
            "tree_fwd_bwd_s": round(tree_s, 4),
            "speedup": round(flat_s / tree_s, 3),
        }
        report[name]["token_ratio"] = round(
            report[name]["flat_tokens"] / report[name]["tree_tokens"], 3
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
