"""Rebuild the tiny MoE checkpoint shipped in ``areal/models/assets/tiny-moe``.

Recipe (seeded; same tokenizer, task and noisy targets as tiny-base):

1. Upcycle tiny-base (the Qwen2 tiny model) into the Qwen3-MoE of
   ``areal.models.tiny_moe.tiny_moe_config``: embeddings, attention (q/k/v biases; a zero
   o_proj bias; q/k norms start at 1) and norms copied; expert ``e`` of a layer takes
   rows ``128e:128(e+1)`` of the dense SwiGLU (gate/up) and the matching columns of its
   down projection, times 2 (two of the four slices are routed, with weights summing to
   1); the routers start at N(0, 0.02).
2. SFT with transformers' Qwen3MoeForCausalLM (its loss includes the load-balancing
   loss, coefficient 0.001) on fresh 1-digit, 2-step add/sub problems, ``--noise`` of
   the targets off by one in the last step as for tiny-base (AdamW lr 1e-3, warm-up 20,
   cosine to 0.1x, batch 64).
3. Greedy and sampled (T=1) accuracy on ``--n-eval`` held-out problems, in the README.

Usage::

    python examples/math/build_tiny_moe.py                  # writes areal/models/assets/tiny-moe
    python examples/math/build_tiny_moe.py --steps 10 --out /tmp/tm   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from build_tiny_base import corrupt_last_step, lr_lambda, make_batch

from areal.dataset.synthetic import ArithSpec, generate_arith_problems
from areal.models.tiny import evaluate_accuracy, get_tiny_base_path, save_tokenizer
from areal.models.tiny_moe import tiny_moe_config

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "areal/models/assets/tiny-moe"


def upcycle(dense, moe) -> None:
    """Copy tiny-base's weights into the MoE (module docstring, step 1)."""
    d, m = dense.state_dict(), moe.state_dict()
    cfg = moe.config
    width = cfg.moe_intermediate_size
    scale = cfg.num_experts / cfg.num_experts_per_tok / 2
    new = {}
    for k, v in m.items():
        if k in d:
            new[k] = d[k]
        elif ".mlp.experts." in k:
            layer = k.split(".")[2]
            pre = f"model.layers.{layer}.mlp."
            gate, up, down = (d[pre + n + "_proj.weight"] for n in ("gate", "up", "down"))
            sl = [slice(width * e, width * (e + 1)) for e in range(cfg.num_experts)]
            if k.endswith("gate_up_proj"):
                new[k] = torch.stack([torch.cat([gate[s], up[s]]) for s in sl])
            else:
                new[k] = torch.stack([down[:, s] * scale * 2 for s in sl])
        else:  # o_proj bias, q/k norms, routers: their fresh init
            new[k] = v
    moe.load_state_dict(new, strict=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--noise", type=float, default=0.6)
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t_start = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    base = get_tiny_base_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(len(tokenizer)), dtype=torch.float32)
    upcycle(dense, model)
    del dense
    model.config.output_router_logits = True  # the training loss adds the aux loss
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params {n_params:,}")

    spec = ArithSpec(
        digits=1, steps=2, ops=("add", "sub"), n=args.steps * args.batch_size, seed=args.seed + 7
    )
    train = generate_arith_problems(spec, split="train")
    rng = random.Random(args.seed + 12345)
    for r in train:
        if rng.random() < args.noise:
            r["answer"] = corrupt_last_step(r["answer"])
    eval_spec = ArithSpec(digits=1, steps=2, ops=("add", "sub"), n=args.n_eval, seed=args.seed)
    held_out = generate_arith_problems(eval_spec, split="test")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, args.steps))
    model.train()
    t_train = time.time()
    loss = torch.zeros(())
    for step in range(args.steps):
        batch = make_batch(tokenizer, train[step * args.batch_size : (step + 1) * args.batch_size])
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f} {time.time() - t_train:.0f}s", flush=True)
    train_s = time.time() - t_train
    model.config.output_router_logits = False

    greedy = evaluate_accuracy(model, tokenizer, held_out, greedy=True)
    sampled = evaluate_accuracy(model, tokenizer, held_out, greedy=False, seed=args.seed)
    results = {
        "greedy_accuracy": greedy["accuracy"],
        "sampled_accuracy_t1": sampled["accuracy"],
        "n_eval": len(held_out),
        "train_steps": args.steps,
        "batch_size": args.batch_size,
        "noise": args.noise,
        "final_loss": loss.item(),
        "train_seconds": round(train_s, 1),
        "n_params": n_params,
    }
    print(json.dumps(results, indent=2))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=48
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)
    (out / "build_results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# tiny-moe: the tiny mixture-of-experts model\n\n"
        f"A {n_params:,}-parameter Qwen3-MoE decoder (hidden 128, 4 layers, 4 heads, 2 KV "
        f"heads, 4 experts of intermediate 128 per layer, top-2 normalised routing, tied "
        f"embeddings, fp32) with tiny-base's tokenizer. Rebuilt by "
        f"`examples/math/build_tiny_moe.py` (upcycled from tiny-base, {args.steps} SFT "
        f"steps of batch {args.batch_size} on tiny-base's task, {args.noise:.0%} noisy "
        f"targets, seed {args.seed}).\n\n"
        f"Held-out ({len(held_out)} problems, true answers): greedy "
        f"{greedy['accuracy']:.1%}, sampled T=1 {sampled['accuracy']:.1%}.\n"
    )
    print(f"saved to {out} in {time.time() - t_start:.0f}s total")


if __name__ == "__main__":
    main()
