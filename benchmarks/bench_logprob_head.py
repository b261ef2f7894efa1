"""The log-probability head alone, forward + backward, at a real model's shape (JSON).

``fused``: today's ``chunked_logprobs_entropy`` (one autograd node per chunk, backward
recomputes the logits and forms ``g * (onehot - softmax)`` in place). ``autograd``: the
earlier path, kept here as the baseline: ``linear -> log_softmax -> gather`` per chunk under
activation checkpointing, the entropy from the log-softmax without gradient.

Default shape: SmolLM2-135M's head (hidden 576, vocabulary 49,152), 4,096 rows (about
half a mini-batch of 8 prompts x 8 samples x 64 new tokens), fp32, chunks of 1,024 rows
(the engine's 128 MiB chunk budget at this vocabulary is ~680 rows; 1,024 is its floor).

    .venv/bin/python benchmarks/bench_logprob_head.py [--rows 4096 --hidden 576 --vocab 49152]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from areal.engine.fsdp.logprob_head import chunked_logprobs_entropy


def _autograd_chunk(hidden, weight, labels):
    logp_all = torch.log_softmax(F.linear(hidden, weight), dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def autograd_head(hidden, weight, labels, chunk):
    out = [
        checkpoint(_autograd_chunk, hidden[s : s + chunk], weight, labels[s : s + chunk],
                   use_reentrant=False)
        for s in range(0, hidden.shape[0], chunk)
    ]  # fmt: skip
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def fused_head(hidden, weight, labels, chunk):
    return chunked_logprobs_entropy(hidden, weight, None, labels, 1.0, chunk)


def _time(fn, hidden, weight, labels, chunk, repeats):
    best = float("inf")
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        t = time.perf_counter()
        logp, _ = fn(hidden, weight, labels, chunk)
        logp.sum().backward()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden = (torch.randn(args.rows, args.hidden) * 0.5).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) * 0.05).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,))
    res = {"rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "threads": args.threads}
    # alternate the two so that a noisy neighbour hits both alike
    a_s, f_s = [], []
    for _ in range(2):
        a_s.append(_time(autograd_head, hidden, weight, labels, args.chunk, args.repeats))
        f_s.append(_time(fused_head, hidden, weight, labels, args.chunk, args.repeats))
    res["autograd_s"] = round(min(a_s), 3)
    res["fused_s"] = round(min(f_s), 3)
    res["fused_over_autograd"] = round(min(f_s) / min(a_s), 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
