"""Rebuild the tiny tool-calling checkpoint shipped in ``areal/models/assets/tiny-tool``.

Recipe (our own; same model size class as ``tiny-base``):

1. Problems: synthetic 2-digit, 2-step add/sub word problems
   (``synthetic://arith?digits=2&steps=2&ops=add,sub``); 2-digit arithmetic is what the
   tiny model cannot do in its head, so the calculator is worth calling.
2. Transcripts, rendered by the model's own chat template with ``tools=[CALCULATOR_TOOL]``:
   user question -> assistant ``<tool_call>{"name": "calculator", "arguments":
   {"expression": "a + b - c"}}</tool_call>`` -> ``tool`` message with the calculator's
   result -> assistant ``The answer is N.``. **Deliberately imperfect**: on ``--p-direct``
   of the rows (default 25%) the assistant answers at once, without a call, with a wrong
   number; on ``--p-wrong-expr`` (default 20%) it calls the tool with a wrong expression
   (one operand or operator changed) and then answers the tool's (wrong) result. RL with a
   reward on the final answer can therefore raise the tool-use success rate.
3. SFT from scratch, loss on assistant tokens only (both assistant turns), plain PyTorch
   loop: one thread, AdamW lr 2e-3, 50-step warm-up, cosine to 0.1x, weight decay 0.01,
   batch 64, a fresh transcript for every sample.
4. Evaluation of the two-turn episode (turn 1 parsed with the ``qwen`` tool-call parser,
   calls executed, result sent back) on held-out problems, greedy and sampled (T=1):
   tool-call rate, correct-expression rate, final-answer accuracy, tool-use success.
   Written to ``build_results.json`` and the checkpoint's ``README.md``.

Usage::

    python examples/agent_workflow/build_tiny_tool_model.py            # writes the asset
    python examples/agent_workflow/build_tiny_tool_model.py --steps 30 --out /tmp/tt  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from areal.dataset.synthetic import ArithSpec, generate_arith_problems
from areal.experimental.openai.tool_call_parser import parse_tool_calls
from areal.models.tiny import (
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    save_tokenizer,
    tiny_model_config,
)
from areal.models.tiny_tool import (
    CALCULATOR_TOOL,
    TOOL_CHAT_TEMPLATE,
    TOOL_TOKENS,
    calculator,
    run_calculator_call,
    tool_answer_reward_fn,
)

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "areal/models/assets/tiny-tool"
SPEC = dict(digits=2, steps=2, ops=("add", "sub"))
CONTEXT_LENGTH = 4096  # positions (max_position_embeddings, tokenizer model_max_length)
_LINE_RE = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)$")
TOOLS = [CALCULATOR_TOOL]


def expression_of(answer: str) -> str:
    """``"31 + 45 = 76\\n76 - 12 = 64\\n#### 64"`` -> ``"31 + 45 - 12"``."""
    parts: list[str] = []
    for line in answer.split("\n")[:-1]:
        a, op, b, _ = _LINE_RE.match(line).groups()
        if not parts:
            parts.append(a)
        parts += [op, b]
    return " ".join(parts)


def wrong_expression(expr: str, rng: random.Random) -> str:
    """Change one operand by 1..9 or flip one operator, so that the value changes."""
    tokens = expr.split(" ")
    while True:
        t = list(tokens)
        i = rng.randrange(len(t))
        if t[i] in "+-":
            t[i] = "-" if t[i] == "+" else "+"
        else:
            t[i] = str(max(1, int(t[i]) + rng.choice([-1, 1]) * rng.randint(1, 9)))
        new = " ".join(t)
        if calculator(new) != calculator(expr):
            return new


def transcript(row: dict, mode: str, rng: random.Random) -> list[dict[str, Any]]:
    """Messages of one episode; ``mode`` is ``correct``, ``wrong_expr`` or ``direct``."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": row["question"]}]
    if mode == "direct":
        guess = row["result"] + rng.choice([-1, 1]) * rng.randint(1, 10)
        msgs.append({"role": "assistant", "content": f"The answer is {max(0, guess)}."})
        return msgs
    expr = expression_of(row["answer"])
    if mode == "wrong_expr":
        expr = wrong_expression(expr, rng)
    result = calculator(expr)
    msgs += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": expr}},
                }
            ],
        },
        {"role": "tool", "content": result, "tool_call_id": "call_0"},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]
    return msgs


def _ids(tokenizer, msgs, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        msgs, tools=TOOLS, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


def encode_transcript(tokenizer, msgs) -> tuple[list[int], list[int]]:
    """Token ids of the whole episode and labels (-100 except on assistant turns)."""
    full = _ids(tokenizer, msgs, False)
    labels = [-100] * len(full)
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(_ids(tokenizer, msgs[:k], True))
        end = len(_ids(tokenizer, msgs[: k + 1], False)) - 1  # drop the trailing "\n"
        assert full[:start] == _ids(tokenizer, msgs[:k], True), "template is not prefix-stable"
        labels[start:end] = full[start:end]
    return full, labels


def make_batch(tokenizer, encoded: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(s) for s, _ in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(encoded), width), -100, dtype=torch.long)
    attn = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, (s, lb) in enumerate(encoded):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
        attn[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": lab}


def lr_lambda(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_tokenizer(seed: int, vocab_size: int):
    """BPE trained on rendered transcripts, plus the two tool-call tokens and the template."""
    scratch = build_tiny_tokenizer(None, ["user assistant tool system"])
    scratch.chat_template = TOOL_CHAT_TEMPLATE
    rng = random.Random(seed + 7)
    rows = generate_arith_problems(ArithSpec(n=4000, seed=seed, **SPEC), split="tokenizer")
    strip = SPECIAL_TOKENS + TOOL_TOKENS
    corpus = []
    for r in rows:
        mode = rng.choice(["correct", "correct", "wrong_expr", "direct"])
        text = scratch.apply_chat_template(transcript(r, mode, rng), tools=TOOLS, tokenize=False)
        for s in strip:
            text = text.replace(s, "\n")
        corpus.append(text)
    tok = build_tiny_tokenizer(None, corpus, vocab_size=vocab_size)
    tok.add_tokens(TOOL_TOKENS)  # non-special: decoding keeps them
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.model_max_length = CONTEXT_LENGTH
    return tok


# ----------------------------------------------------------------------------- evaluation
def _generate(model, tokenizer, prompts, greedy: bool, max_new_tokens: int, seed: int):
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_p=None,
            top_k=None,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
    texts = []
    for seq in out[:, width:].tolist():
        if eos_id in seq:
            seq = seq[: seq.index(eos_id)]
        texts.append(tokenizer.decode(seq, skip_special_tokens=True))
    return texts


def evaluate_tool_use(
    model, tokenizer, problems: list[dict], *, greedy: bool, seed: int = 0, batch_size: int = 128
) -> dict[str, Any]:
    """Two-turn calculator episodes on ``problems``; rates over all problems.

    ``tool_call_rate``: turn 1 is exactly one valid calculator call; ``expression_correct``:
    that call evaluates to the true result; ``accuracy``: the final answer's last number is
    the true result; ``tool_success``: correct call AND correct final answer.
    """
    model.eval()
    n_call = n_expr = n_acc = n_success = 0
    examples: list[dict] = []
    for start in range(0, len(problems), batch_size):
        rows = problems[start : start + batch_size]
        msgs = [[{"role": "user", "content": r["question"]}] for r in rows]
        first = _generate(
            model, tokenizer, [_ids(tokenizer, m, True) for m in msgs], greedy, 48, seed + start
        )
        finals, expr_ok = list(first), [False] * len(rows)
        idx, prompts = [], []
        for i, (r, text) in enumerate(zip(rows, first, strict=True)):
            content, calls = parse_tool_calls(text, "qwen", TOOLS)
            if len(calls) != 1:
                continue
            n_call += 1
            result = run_calculator_call(calls[0].arguments)
            expr_ok[i] = result == str(r["result"])
            call = {"name": calls[0].name, "arguments": calls[0].arguments}
            msgs[i] += [
                {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [{"id": "c", "type": "function", "function": call}],
                },
                {"role": "tool", "content": result, "tool_call_id": "c"},
            ]
            idx.append(i)
            prompts.append(_ids(tokenizer, msgs[i], True))
        if prompts:
            second = _generate(model, tokenizer, prompts, greedy, 24, seed + start + 1)
            for i, text in zip(idx, second, strict=True):
                finals[i] = text
        for i, r in enumerate(rows):
            ok = tool_answer_reward_fn(finals[i], r["result"]) == 1.0
            n_expr += expr_ok[i]
            n_acc += ok
            n_success += ok and expr_ok[i]
            if len(examples) < 4:
                examples.append(dict(question=r["question"], turn1=first[i], final=finals[i]))
    model.train()
    n = len(problems)
    return {
        "tool_call_rate": n_call / n,
        "expression_correct": n_expr / n,
        "accuracy": n_acc / n,
        "tool_success": n_success / n,
        "examples": examples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--p-direct", type=float, default=0.25)
    ap.add_argument("--p-wrong-expr", type=float, default=0.20)
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument(
        "--rewrite-readme",
        action="store_true",
        help="only rewrite OUT/README.md from OUT/build_results.json (no training)",
    )
    args = ap.parse_args()
    if args.rewrite_readme:
        results = json.loads((args.out / "build_results.json").read_text())
        (args.out / "README.md").write_text(readme_text(results))
        print(f"rewrote {args.out / 'README.md'}")
        return
    if not 0 <= args.p_direct + args.p_wrong_expr <= 1:
        raise ValueError("--p-direct + --p-wrong-expr must be in [0, 1]")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t_start = time.time()
    tokenizer = build_tokenizer(args.seed, args.vocab_size)

    rng = random.Random(args.seed + 12345)
    train = generate_arith_problems(
        ArithSpec(n=args.steps * args.batch_size, seed=args.seed, **SPEC), split="train"
    )
    modes = []
    for _ in train:
        u = rng.random()
        modes.append(
            "direct"
            if u < args.p_direct
            else "wrong_expr"
            if u < args.p_direct + args.p_wrong_expr
            else "correct"
        )
    held_out = generate_arith_problems(
        ArithSpec(n=args.n_eval, seed=args.seed, **SPEC), split="test"
    )
    mix = {m: modes.count(m) / len(modes) for m in ("correct", "wrong_expr", "direct")}
    print(f"train rows {len(train)} mix {mix}; held-out {len(held_out)}; vocab {len(tokenizer)}")

    from transformers import AutoModelForCausalLM, GenerationConfig

    # 4,096 positions: agent SDK prompts with tool schemas (openai-agents: ~1,134 tokens)
    # fit; RoPE has no position table, so the count changes no weight and no short output.
    model = AutoModelForCausalLM.from_config(
        tiny_model_config(len(tokenizer), max_position_embeddings=CONTEXT_LENGTH)
    )
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, args.warmup, args.steps))
    model.train()
    t_train = time.time()
    n_tokens = 0
    for step in range(args.steps):
        lo, hi = step * args.batch_size, (step + 1) * args.batch_size
        encoded = [
            encode_transcript(tokenizer, transcript(r, m, rng))
            for r, m in zip(train[lo:hi], modes[lo:hi], strict=True)
        ]
        batch = make_batch(tokenizer, encoded)
        n_tokens += int(batch["attention_mask"].sum())
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"step {step:4d} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"elapsed {time.time() - t_train:.0f}s",
                flush=True,
            )
    train_s = time.time() - t_train

    t_eval = time.time()
    greedy = evaluate_tool_use(model, tokenizer, held_out, greedy=True)
    sampled = evaluate_tool_use(model, tokenizer, held_out, greedy=False, seed=args.seed)
    eval_s = time.time() - t_eval
    results = {
        "greedy": {k: v for k, v in greedy.items() if k != "examples"},
        "sampled_t1": {k: v for k, v in sampled.items() if k != "examples"},
        "greedy_examples": greedy["examples"],
        "n_eval": len(held_out),
        "train_mix": mix,
        "p_direct": args.p_direct,
        "p_wrong_expr": args.p_wrong_expr,
        "train_steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup": args.warmup,
        "mean_tokens_per_transcript": round(n_tokens / (args.steps * args.batch_size), 1),
        "final_loss": loss.item(),
        "train_seconds": round(train_s, 1),
        "eval_seconds": round(eval_s, 1),
        "n_params": n_params,
        "vocab_size": len(tokenizer),
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
    (out / "README.md").write_text(readme_text(results))
    print(f"saved to {out} in {time.time() - t_start:.0f}s total")


def readme_text(r: dict) -> str:
    g, s = r["greedy"], r["sampled_t1"]
    mix = r["train_mix"]
    return f"""# tiny-tool: a tiny tool-calling model for CPU tests and demos

A {r["n_params"]:,}-parameter Qwen2 decoder (hidden 128, 4 layers, 4 heads, 2 KV heads,
tied embeddings, fp32; the shape of `tiny-base`, with 4,096 positions: agent SDK prompts
with tool schemas fit) with a {r["vocab_size"]}-token byte-level BPE
tokenizer (every digit one token; `<tool_call>` and `</tool_call>` single non-special
tokens) and a ChatML chat template that renders `tools=`, assistant `tool_calls` and `tool`
messages (`areal.models.tiny_tool.TOOL_CHAT_TEMPLATE`). Rebuilt by
`examples/agent_workflow/build_tiny_tool_model.py`; load it with
`areal.models.tiny_tool.get_tiny_tool_path()`.

## What it was trained to do

Synthetic 2-digit, 2-step add/sub word problems. Offered the `calculator` tool
(`areal.models.tiny_tool.CALCULATOR_TOOL`), the assistant calls it as
`<tool_call>{{"name": "calculator", "arguments": {{"expression": "31 + 45 - 12"}}}}</tool_call>`,
reads the `tool` message with the result, then answers `The answer is N.`

**Deliberately imperfect transcripts** (so that RL has something to improve):
{mix["correct"]:.0%} call the tool correctly, {mix["wrong_expr"]:.0%} call it with a wrong
expression (one operand or operator changed) and answer the wrong result, {mix["direct"]:.0%}
answer at once without a call, with a wrong number.

SFT from scratch, loss on assistant tokens only: {r["train_steps"]} steps x batch
{r["batch_size"]} (a fresh transcript per sample, ~{r["mean_tokens_per_transcript"]:.0f} tokens
each), AdamW lr {r["lr"]:g}, {r["warmup"]}-step warm-up, cosine to 0.1x, weight decay 0.01,
1 CPU thread: {r["train_seconds"]:.0f} s on a shared 2-core machine. Final loss
{r["final_loss"]:.3f}.

## Measured on {r["n_eval"]} held-out problems (two-turn episode, calls executed)

| metric | greedy | sampled (T=1) |
|---|---|---|
| turn 1 is a valid calculator call (`qwen` parser) | {g["tool_call_rate"]:.1%} | {s["tool_call_rate"]:.1%} |
| the call's expression gives the true result | {g["expression_correct"]:.1%} | {s["expression_correct"]:.1%} |
| final answer correct | {g["accuracy"]:.1%} | {s["accuracy"]:.1%} |
| tool-use success (correct call and correct answer) | {g["tool_success"]:.1%} | {s["tool_success"]:.1%} |

A reward on the final answer (`areal.models.tiny_tool.tool_answer_reward_fn`) favours
episodes that call the tool with the right expression and copy its result: that is what RL
can raise.
"""


if __name__ == "__main__":
    main()
