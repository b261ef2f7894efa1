"""Greedy held-out accuracy of checkpoints on the CPU demo's validation problems.

python examples/distillation/eval_heldout.py areal/models/assets/tiny-base CKPT_DIR ...

Plain transformers generation in this process (no inference server, no reward process
pool), scored against the true answers with ``gsm8k_reward_fn``; prints one JSON object
``{checkpoint: accuracy}``. The problems are those of the demo's ``valid_dataset``
(``synthetic://arith?digits=1&steps=2&n=512&seed=12345``, split ``test``).
"""

import argparse
import json

import torch

from areal.dataset.synthetic import ArithSpec, generate_arith_problems
from areal.models.tiny import evaluate_accuracy
from areal.utils.hf_utils import load_hf_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--n", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    problems = generate_arith_problems(ArithSpec(digits=1, steps=2, n=args.n, seed=12345), "test")
    out = {}
    for path in args.checkpoints:
        tok = load_hf_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out[path] = evaluate_accuracy(model, tok, problems)["accuracy"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
