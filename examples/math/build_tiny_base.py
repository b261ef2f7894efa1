"""Rebuild the tiny base checkpoint shipped in ``areal/models/assets/tiny-base``.

Recipe (what NOTES "Learning on CPU" measured to leave room for verifiable-reward RL):

1. Train the 384-token byte-level BPE tokenizer (every digit its own token) on synthetic
   problem text.
2. SFT a Qwen2 model (hidden 128, 4 layers, 4 heads, 2 KV heads, tied embeddings, ~1.03M
   parameters) from scratch on synthetic 1-digit, 2-step add/sub word problems in GSM8K
   format. The target is deliberately imperfect: on ``--noise`` (default 60%) of the
   training rows the last reasoning line's result AND the final ``#### N`` are off by one
   (N+1). The base therefore learns the format and most of the arithmetic, but gets the
   final step wrong about as often as its data did; RL against the true answers can fix
   that.
3. Report greedy and sampled (T=1) accuracy on 512 held-out problems (split ``test``),
   scored against the TRUE answers, and write them into the checkpoint's README.md.

This is a plain PyTorch/transformers loop (one thread, AdamW lr 2e-3, 50-step linear
warm-up, cosine decay to 0.1x, weight decay 0.01, batch 64, a fixed number of steps):
the project's SFTTrainer does not exist yet.

Usage::

    python examples/math/build_tiny_base.py                  # writes areal/models/assets/tiny-base
    python examples/math/build_tiny_base.py --steps 50 --out /tmp/tiny   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch

from areal.dataset.synthetic import ArithSpec, generate_arith_problems
from areal.models.tiny import (
    _chat_prompt_ids,
    build_tiny_tokenizer,
    evaluate_accuracy,
    save_tokenizer,
    tiny_model_config,
)

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "areal/models/assets/tiny-base"
_LINE_RE = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)$")


def corrupt_last_step(answer: str) -> str:
    """Off-by-one the last reasoning line's result and the final ``#### N`` (N+1)."""
    lines = answer.split("\n")
    m = _LINE_RE.match(lines[-2])
    assert m is not None and lines[-1].startswith("#### "), answer
    wrong = int(m.group(4)) + 1
    lines[-2] = f"{m.group(1)} {m.group(2)} {m.group(3)} = {wrong}"
    lines[-1] = f"#### {wrong}"
    return "\n".join(lines)


def last_line_correct(completion: str) -> bool:
    """Whether the last ``a op b = c`` line of a completion is correct arithmetic."""
    found = [m for m in (_LINE_RE.match(x.strip()) for x in completion.split("\n")) if m]
    if not found:
        return False
    a, op, b, c = found[-1].groups()
    a, b, c = int(a), int(b), int(c)
    return c == (a + b if op == "+" else a - b if op == "-" else a * b)


def lr_lambda(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside the target)."""
    seqs, labels = [], []
    for r in rows:
        prompt = _chat_prompt_ids(tokenizer, [{"role": "user", "content": r["question"]}])
        target = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        seqs.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
        attn[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": lab}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument(
        "--noise", type=float, default=0.6, help="fraction of rows with an off-by-one last step"
    )
    ap.add_argument("--n-eval", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument(
        "--rewrite-readme",
        action="store_true",
        help="only rewrite OUT/README.md from OUT/build_results.json (no training)",
    )
    args = ap.parse_args()
    if args.rewrite_readme:
        results = json.loads((args.out / "build_results.json").read_text())
        args.noise = results["noise"]
        (args.out / "README.md").write_text(readme_text(results, args))
        print(f"rewrote {args.out / 'README.md'}")
        return

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t_start = time.time()

    # 1. tokenizer
    corpus_rows = generate_arith_problems(ArithSpec(n=5000, seed=args.seed), split="tokenizer")
    corpus = [r["question"] + "\n" + r["answer"] + "\nuser\nassistant\n" for r in corpus_rows]
    tokenizer = build_tiny_tokenizer(None, corpus)

    # 2. data: fresh problems for every step (no repeats), noisy targets
    train_spec = ArithSpec(
        digits=1, steps=2, ops=("add", "sub"), n=args.steps * args.batch_size, seed=args.seed
    )
    train = generate_arith_problems(train_spec, split="train")
    noise_rng = random.Random(args.seed + 12345)
    n_noisy = 0
    for r in train:
        if noise_rng.random() < args.noise:
            r["answer"] = corrupt_last_step(r["answer"])
            n_noisy += 1
    eval_spec = ArithSpec(digits=1, steps=2, ops=("add", "sub"), n=args.n_eval, seed=args.seed)
    held_out = generate_arith_problems(eval_spec, split="test")
    print(
        f"train rows {len(train)} ({n_noisy / len(train):.1%} off-by-one), held-out {len(held_out)}"
    )

    # 3. model + optimiser
    config = tiny_model_config(len(tokenizer))
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params {n_params:,}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, args.steps))

    model.train()
    t_train = time.time()
    for step in range(args.steps):
        batch = make_batch(tokenizer, train[step * args.batch_size : (step + 1) * args.batch_size])
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} elapsed {el:.0f}s",
                flush=True,
            )
    train_s = time.time() - t_train

    # 4. evaluation against the TRUE answers
    t_eval = time.time()
    greedy = evaluate_accuracy(model, tokenizer, held_out, greedy=True)
    sampled = evaluate_accuracy(
        model, tokenizer, held_out, greedy=False, temperature=1.0, seed=args.seed
    )
    last_line = sum(last_line_correct(c) for c in greedy["completions"]) / len(held_out)
    format_ok = sum("####" in c for c in greedy["completions"]) / len(held_out)
    off_by_one = sum(
        (m := re.search(r"#### (\d+)", c)) is not None and int(m.group(1)) == r["result"] + 1
        for c, r in zip(greedy["completions"], held_out, strict=True)
    ) / len(held_out)
    eval_s = time.time() - t_eval
    results = {
        "greedy_accuracy": greedy["accuracy"],
        "sampled_accuracy_t1": sampled["accuracy"],
        "greedy_last_line_correct": last_line,
        "greedy_answer_is_true_plus_one": off_by_one,
        "greedy_has_final_answer_line": format_ok,
        "n_eval": len(held_out),
        "train_steps": args.steps,
        "batch_size": args.batch_size,
        "noise": args.noise,
        "final_loss": loss.item(),
        "train_seconds": round(train_s, 1),
        "eval_seconds": round(eval_s, 1),
        "n_params": n_params,
    }
    print(json.dumps(results, indent=2))
    for c, r in list(zip(greedy["completions"], held_out, strict=True))[:3]:
        print(
            "---",
            r["question"],
            "\n>>>",
            c.replace("\n", " | "),
            "\n(true)",
            r["answer"].replace("\n", " | "),
        )

    # 5. save
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=48
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)
    (out / "build_results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "README.md").write_text(readme_text(results, args))
    print(f"saved to {out} in {time.time() - t_start:.0f}s total")


def readme_text(r: dict, args) -> str:
    return f"""# tiny-base: the default CPU model

A {r["n_params"]:,}-parameter Qwen2 decoder (hidden 128, 4 layers, 4 heads, 2 KV heads,
tied embeddings, fp32) with a 384-token byte-level BPE tokenizer in which every digit is a
single token, and a ChatML chat template. Rebuilt by `examples/math/build_tiny_base.py`.

## Training (SFT from scratch)

- Data: synthetic 1-digit, 2-step add/sub word problems in GSM8K format
  (`synthetic://arith?digits=1&steps=2&ops=add,sub`), a fresh problem for every sample.
- **Deliberately imperfect target:** on {args.noise:.0%} of the training rows the last
  reasoning line's result and the final `#### N` line are off by one (N+1).
- {r["train_steps"]} steps x batch {r["batch_size"]}, AdamW lr {args.lr:g}, {args.warmup}-step warm-up,
  cosine to 0.1x, weight decay 0.01, 1 CPU thread: {r["train_seconds"]:.0f} s on a shared
  2-core machine. Final loss {r["final_loss"]:.3f}.

## Accuracy on 512 held-out problems, against the TRUE answers

| metric | value |
|---|---|
| greedy accuracy | {r["greedy_accuracy"]:.1%} |
| sampled accuracy (T=1) | {r["sampled_accuracy_t1"]:.1%} |
| greedy: last reasoning line arithmetically correct | {r["greedy_last_line_correct"]:.1%} |
| greedy: final answer = true + 1 (the injected error) | {r["greedy_answer_is_true_plus_one"]:.1%} |
| greedy: has a `#### N` line | {r["greedy_has_final_answer_line"]:.1%} |

## What the base lacks

It writes the format (`a op b = c` lines, then `#### N`) and usually the first step, but
by construction of its data it gets the arithmetic of the final step wrong (off by one)
most of the time: {args.noise:.0%} of its targets were N+1, so N+1 is the mode it learned,
and greedy decoding picks it ({r["greedy_answer_is_true_plus_one"]:.0%} of held-out problems).
Sampling at T=1 still puts real probability on the true result, which is why sampled
accuracy can exceed greedy accuracy. A verifiable reward against the true answers
(`areal.reward.gsm8k.gsm8k_reward_fn`) gives RL a signal to move that mass to the
correct result: this is what the CPU RL demo measures.

Reference: the same recipe with 400 steps (442 s) gave greedy 19.9% / sampled 29.5%;
longer SFT sharpens both the arithmetic and the learned N+1 bias.
"""


if __name__ == "__main__":
    main()
