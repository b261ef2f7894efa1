"""Tree attention on CPU: the masked SDPA that tree training uses against FlexAttention,
one JSON object.

For the tree-training benchmark's ``agent`` and ``dpo`` batches (one packed micro-batch
each, laid out as its prefix trie by ``plan_tree``) and the shipped tiny-base model's
attention shape, on random queries/keys/values, one torch thread:

- ``sdpa_buckets``: ``tree_attention`` as the engine runs it (chains batched into padded
  SDPA calls under an explicit mask), forward and forward + backward;
- ``sdpa_dense``: one SDPA call over all stored tokens with the dense ancestor mask;
- ``flex``: ``flex_attention`` with the block mask of the same ancestor relation, compiled
  (``torch.compile``; its compile time reported apart), forward; its backward is tried and
  the error recorded (torch 2.13 has no FlexAttention backward on CPU).

Each figure is the best of ``--repeats`` after a warm-up. Outputs are checked equal.

Usage: ``.venv/bin/python benchmarks/bench_tree_attention.py [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_tree_training import agent_rows, dpo_rows  # noqa: E402

from areal.engine.fsdp.tree_attention import plan_tree, tree_attention  # noqa: E402
from areal.utils.cpu_info import cpu_kind  # noqa: E402


def dense_ancestor_mask(plan) -> torch.Tensor:
    """``[Nc, Nc]``: stored row i attends to stored row j (the plan's buckets, scattered)."""
    nc = plan.n_tokens
    dense = torch.zeros(nc + 1, nc + 1, dtype=torch.bool)
    for rows, keys, mask in zip(plan.rows, plan.keys, plan.mask, strict=True):
        m, lq = rows.shape
        q = rows[:, :, None].expand(m, lq, keys.shape[1])
        k = keys[:, None, :].expand(m, lq, keys.shape[1])
        dense[q[mask[:, 0]], k[mask[:, 0]]] = True
    return dense[:nc, :nc]


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return round(min(out), 4)


def measure(rows: list[torch.Tensor], heads: int, kv_heads: int, head_dim: int, repeats: int):
    ids = torch.cat(rows)
    cu = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).int()
    plan = plan_tree(ids, cu)
    nc = plan.n_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, nc, head_dim, generator=g)
    k = torch.randn(1, kv_heads, nc, head_dim, generator=g)
    v = torch.randn(1, kv_heads, nc, head_dim, generator=g)
    gqa = heads != kv_heads
    dense = dense_ancestor_mask(plan)
    out: dict = {"packed_tokens": int(ids.numel()), "stored_tokens": plan.n_stored,
                 "mask_density": round(float(dense.float().mean()), 4)}  # fmt: skip

    def buckets(backward: bool):
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        o = tree_attention(plan, qq, kk, vv, 0.0, None, gqa)
        if backward:
            o.sum().backward()
        return o

    def sdpa_dense(backward: bool):
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense, enable_gqa=gqa)
        if backward:
            o.sum().backward()
        return o.transpose(1, 2)

    ref = buckets(False)
    assert torch.allclose(sdpa_dense(False), ref, atol=1e-5)
    for name, fn in (("sdpa_buckets", buckets), ("sdpa_dense", sdpa_dense)):
        out[name] = {
            "forward_s": best(lambda fn=fn: fn(False), repeats),
            "forward_backward_s": best(lambda fn=fn: fn(True), repeats),
        }
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def ancestor(b, h, qi, ki):
        return dense[qi, ki]

    block = create_block_mask(ancestor, 1, 1, nc, nc, device="cpu")
    flex = torch.compile(flex_attention)
    t0 = time.perf_counter()
    with torch.no_grad():
        o = flex(q, k, v, block_mask=block, enable_gqa=gqa)
    compile_s = time.perf_counter() - t0
    assert torch.allclose(o.transpose(1, 2), ref, atol=1e-5)

    def flex_fwd():
        with torch.no_grad():
            flex(q, k, v, block_mask=block, enable_gqa=gqa)

    out["flex"] = {"compile_s": round(compile_s, 1), "forward_s": best(flex_fwd, repeats)}
    try:
        qq = q.detach().requires_grad_(True)
        flex(qq, k, v, block_mask=block, enable_gqa=gqa).sum().backward()
        out["flex"]["forward_backward_s"] = best(
            lambda: flex(q.detach().requires_grad_(True), k, v, block_mask=block,
                         enable_gqa=gqa).sum().backward(), repeats)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the measured answer: not on this device
        out["flex"]["backward"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from areal.models.tiny import get_tiny_base_path

    cfg = AutoConfig.from_pretrained(get_tiny_base_path())
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    result = {"benchmark": "tree_attention", "cpu": cpu_kind(), "torch": torch.__version__,
              "heads": heads, "kv_heads": kv, "head_dim": head_dim, "workloads": {}}  # fmt: skip
    vocab = int(cfg.vocab_size)
    for name, rows in (("agent", agent_rows(vocab)), ("dpo", dpo_rows(vocab))):
        result["workloads"][name] = measure(rows, heads, kv, head_dim, args.repeats)
        print(json.dumps({name: result["workloads"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
