"""Per count class: how much the tiny VLM prefers the off-by-one answer over the true one.

    python examples/vlm/answer_margins.py [MODEL_DIR] [--seed 12345] [--n 256]

For each scene of ``synthetic://clevr?query=all&max_count=4`` (the demo's held-out set by
default), the log-probability of the digit ``N+1`` minus that of the true ``N`` right after
the answer's ``[``. Greedy decoding answers ``[N+1]`` while the margin is positive, so a
count class's greedy accuracy flips once its margin is crossed. Prints JSON per class.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from areal.dataset.synthetic_clevr import (  # noqa: E402
    CLEVR_PROMPT_SUFFIX,
    ClevrSpec,
    generate_clevr_rows,
)
from areal.models.tiny_vlm import collate_vlm_prompts, get_tiny_vlm_path  # noqa: E402


def answer_margins(model, processor, rows, batch_size: int = 64) -> dict[int, list[float]]:
    """``{count: [logp(N+1) - logp(N) per scene]}`` for the digit after ``[``."""
    tok = processor.tokenizer
    bracket = tok.encode("[", add_special_tokens=False)
    digit = {k: tok.encode(str(k), add_special_tokens=False)[0] for k in range(10)}
    out: dict[int, list[float]] = {}
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        b = collate_vlm_prompts(processor, chunk, CLEVR_PROMPT_SUFFIX)
        n = len(chunk)
        extra = torch.tensor(bracket).repeat(n, 1)
        with torch.no_grad():
            logits = model(
                input_ids=torch.cat([b["input_ids"], extra], 1),
                attention_mask=torch.cat([b["attention_mask"], torch.ones_like(extra)], 1),
                mm_token_type_ids=torch.cat(
                    [b["mm_token_type_ids"], torch.zeros_like(extra, dtype=torch.int32)], 1
                ),
                pixel_values=b["pixel_values"],
                image_grid_thw=b["image_grid_thw"],
            ).logits[:, -1]
        logp = logits.float().log_softmax(-1)
        for i, row in enumerate(chunk):
            c = int(row["answer"])
            out.setdefault(c, []).append(float(logp[i, digit[c + 1]] - logp[i, digit[c]]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", nargs="?", default=None, help="model dir (default: tiny-vlm)")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--n", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import Qwen2VLForConditionalGeneration

    from areal.utils.vlm import load_vlm_processor

    path = args.model or get_tiny_vlm_path()
    processor = load_vlm_processor(path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    rows = generate_clevr_rows(
        ClevrSpec(n=args.n, query="all", max_objects=4, seed=args.seed), "test"
    )
    margins = answer_margins(model, processor, rows)
    result = {
        str(c): {
            "n": len(m),
            "mean_margin": round(sum(m) / len(m), 3),
            "min_margin": round(min(m), 3),
            "greedy_correct": sum(x < 0 for x in m),
        }
        for c, m in sorted(margins.items())
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
