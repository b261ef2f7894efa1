"""Rebuild ``areal/models/assets/tiny-tool-mix``: the base model of the necessary-tool task.

Recipe (seeded; our own):

1. Start from the shipped ``tiny-tool`` checkpoint (same tokenizer and chat template).
2. Transcripts of ``A * B + C`` problems (:mod:`areal.dataset.tool_arith`, split
   ``train``), rendered with ``tools=[STEP_CALCULATOR_TOOL]``: a **mix** of ``tool``
   episodes (two calls of the one-operation calculator over two turns, then the copied
   answer) and ``direct`` episodes (an immediate wrong guess of the right size). The tool
   share depends on the question's template: ``--p-tool-hint`` (0.9) for template 0, which
   names the calculator, ``--p-tool`` (0.3) for the others. Greedy decoding therefore
   calls the tool on roughly a quarter of the problems; sampling does so more often on the
   rest, and only calls give correct answers: that is what RL can amplify.
3. SFT, loss on assistant tokens only, AdamW, warm-up then cosine, one thread.
4. Evaluation on held-out problems (split ``test``): greedy multi-call episodes, the
   calls executed (:func:`run_episodes`), and the same episodes with the tool disabled
   (a call ends the episode unanswered). Written to ``build_results.json`` and README.md.

Usage::

    python examples/tool_task/build_tiny_tool_mix.py                  # writes the asset
    python examples/tool_task/build_tiny_tool_mix.py --steps 20 --out /tmp/ttm   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from areal.dataset.tool_arith import generate_tool_arith_problems, transcript
from areal.experimental.openai.tool_call_parser import parse_tool_calls
from areal.models.tiny_tool import get_tiny_tool_path
from areal.reward.tool_arith import STEP_CALCULATOR_TOOL, run_step_call, tool_arith_reward_fn

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "areal/models/assets/tiny-tool-mix"
TOOLS = [STEP_CALCULATOR_TOOL]
MAX_CALLS = 3  # model calls per episode: two tool calls and the answer


def ids_of(tokenizer, msgs, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        msgs, tools=TOOLS, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


def encode(tokenizer, msgs) -> tuple[list[int], list[int]]:
    """Token ids of an episode and labels (-100 except on the assistant turns)."""
    full = ids_of(tokenizer, msgs, False)
    labels = [-100] * len(full)
    for k, m in enumerate(msgs):
        if m["role"] == "assistant":
            start = len(ids_of(tokenizer, msgs[:k], True))
            end = len(ids_of(tokenizer, msgs[: k + 1], False)) - 1  # without the "\n"
            labels[start:end] = full[start:end]
    return full, labels


def generate(model, tokenizer, prompts: list[list[int]], greedy: bool, max_new: int, seed: int):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    texts = []
    for seq in out[:, width:].tolist():
        seq = seq[: seq.index(eos)] if eos in seq else seq
        texts.append(tokenizer.decode(seq, skip_special_tokens=True))
    return texts


def run_episodes(
    model, tokenizer, rows: list[dict], *, greedy: bool = True, tool: bool = True, seed: int = 0
) -> dict[str, Any]:
    """Multi-call episodes (at most :data:`MAX_CALLS` model calls) on ``rows``.

    With ``tool=False`` a tool call ends the episode unanswered (the tool is disabled), so
    only direct answers can score. Returns ``success`` (final answer correct), the share of
    episodes that called the tool, the mean number of model calls, and per-template success.
    """
    model.eval()
    msgs = [[{"role": "user", "content": r["question"]}] for r in rows]
    final: list[str] = [""] * len(rows)
    called = [False] * len(rows)
    n_calls = [0] * len(rows)
    live = list(range(len(rows)))
    for turn in range(MAX_CALLS):
        if not live:
            break
        texts = generate(
            model, tokenizer, [ids_of(tokenizer, msgs[i], True) for i in live], greedy, 32, seed
        )
        nxt = []
        for i, text in zip(live, texts, strict=True):
            n_calls[i] += 1
            content, calls = parse_tool_calls(text, "qwen", TOOLS)
            if not calls:
                final[i] = text
                continue
            called[i] = True
            if not tool or turn == MAX_CALLS - 1:
                continue
            result = run_step_call(calls[0].arguments)
            call = {"name": calls[0].name, "arguments": calls[0].arguments}
            msgs[i] += [
                {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [{"id": f"c{turn}", "type": "function", "function": call}],
                },
                {"role": "tool", "content": result, "tool_call_id": f"c{turn}"},
            ]
            nxt.append(i)
        live = nxt
        seed += 1
    model.train()
    ok = [tool_arith_reward_fn(final[i], r["result"]) == 1.0 for i, r in enumerate(rows)]
    per_t: dict[int, list[bool]] = {}
    for r, o in zip(rows, ok, strict=True):
        per_t.setdefault(r["template"], []).append(o)
    n = max(1, len(rows))
    return {
        "success": sum(ok) / n,
        "tool_called": sum(called) / n,
        "mean_model_calls": sum(n_calls) / n,
        "success_by_template": {t: sum(v) / len(v) for t, v in sorted(per_t.items())},
        "examples": [msgs[i][1:] + [{"final": final[i]}] for i in range(min(2, len(rows)))],
    }


def lr_at(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--p-tool-hint", type=float, default=0.9)
    ap.add_argument("--p-tool", type=float, default=0.3)
    ap.add_argument("--n-eval", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.time()
    src = get_tiny_tool_path()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    rng = random.Random(args.seed + 12345)
    train = generate_tool_arith_problems(args.steps * args.batch_size, args.seed, "train")
    held_out = generate_tool_arith_problems(args.n_eval, args.seed, "test")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args.warmup, args.steps))
    model.train()
    n_tool = 0
    for step in range(args.steps):
        encoded = []
        for r in train[step * args.batch_size : (step + 1) * args.batch_size]:
            p = args.p_tool_hint if r["template"] == 0 else args.p_tool
            mode = "tool" if rng.random() < p else "direct"
            n_tool += mode == "tool"
            encoded.append(encode(tokenizer, transcript(r, mode, rng)))
        width = max(len(s) for s, _ in encoded)
        ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
        lab = torch.full((len(encoded), width), -100, dtype=torch.long)
        attn = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, (s, lb) in enumerate(encoded):
            ids[i, : len(s)], lab[i, : len(s)], attn[i, : len(s)] = (
                torch.tensor(s),
                torch.tensor(lb),
                1,
            )
        loss = model(input_ids=ids, attention_mask=attn, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
    train_s = time.time() - t0
    greedy = run_episodes(model, tokenizer, held_out, greedy=True)
    no_tool = run_episodes(model, tokenizer, held_out, greedy=True, tool=False)
    sampled = run_episodes(model, tokenizer, held_out, greedy=False, seed=args.seed)
    results = {
        "greedy": {k: v for k, v in greedy.items() if k != "examples"},
        "greedy_tool_disabled": {k: v for k, v in no_tool.items() if k != "examples"},
        "sampled_t1": {k: v for k, v in sampled.items() if k != "examples"},
        "greedy_examples": greedy["examples"],
        "n_eval": len(held_out),
        "train_tool_share": n_tool / (args.steps * args.batch_size),
        "p_tool_hint": args.p_tool_hint,
        "p_tool": args.p_tool,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "final_loss": loss.item(),
        "train_seconds": round(train_s, 1),
    }
    print(json.dumps(results, indent=2))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    for name in ("chat_template.jinja",):
        if (Path(src) / name).exists() and not (out / name).exists():
            shutil.copy(Path(src) / name, out / name)
    (out / "build_results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "README.md").write_text(readme_text(results))
    print(f"saved to {out} in {time.time() - t0:.0f}s")


def readme_text(r: dict) -> str:
    g, d, s = r["greedy"], r["greedy_tool_disabled"], r["sampled_t1"]
    return f"""# tiny-tool-mix: the base model of the necessary-tool task

`tiny-tool` (same weights shape, tokenizer and chat template) fine-tuned on a mix of
`A * B + C` transcripts (two-digit A, B; three-digit C; `areal.dataset.tool_arith`):
{r["train_tool_share"]:.0%} call the one-operation calculator twice over two turns
(`A * B`, then `P + C`) and copy its result; the others answer at once with a wrong guess.
The tool share is {r["p_tool_hint"]:.0%} for the question template that names the
calculator and {r["p_tool"]:.0%} for the other three. Rebuilt by
`examples/tool_task/build_tiny_tool_mix.py` (seed {r["seed"]}, {r["steps"]} steps x batch
{r["batch_size"]}, lr {r["lr"]:g}, {r["train_seconds"]:.0f} s on one thread); final loss
{r["final_loss"]:.3f}.

## Held-out ({r["n_eval"]} problems), episodes of at most 3 model calls

| | greedy | greedy, tool disabled | sampled (T=1) |
|---|---|---|---|
| final answer correct | {g["success"]:.1%} | {d["success"]:.1%} | {s["success"]:.1%} |
| episodes that call the tool | {g["tool_called"]:.1%} | {d["tool_called"]:.1%} | {s["tool_called"]:.1%} |
| model calls per episode | {g["mean_model_calls"]:.2f} | {d["mean_model_calls"]:.2f} | {s["mean_model_calls"]:.2f} |

Greedy success by template: {g["success_by_template"]}. Without the tool the model cannot
answer (its direct guesses are wrong); RL on the final answer raises the share of episodes
that use the tool.
"""


if __name__ == "__main__":
    main()
