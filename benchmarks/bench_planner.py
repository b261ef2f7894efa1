"""The planner's memory estimates (``areal.utils.memory_plan``) against measured peak RSS on CPU.

For each random Qwen2 shape and micro-batch token budget, two subprocesses measure (one
torch thread each): the trainer (build the model in fp32, one forward + backward through
the engine's chunked log-prob head on a packed micro-batch, one AdamW step, foreach as
the engine uses on CPU) and the inference server (the built-in server's ``GenerationCore``
serving ``concurrency`` requests of ``prompt_len`` + ``max_new_tokens`` tokens, admitted
together). Each reports its peak RSS (``VmHWM``, reset after the baseline) above the RSS
after the imports and a warm-up; the estimate is computed here from the same shapes.
Printed as one JSON object.

Usage: ``nice -n 10 .venv/bin/python benchmarks/bench_planner.py [--sizes 30m,125m,500m]``
(500M needs ~8 GB of RAM). ``--point JSON`` runs one measurement (used by the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {
    "10m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=8192),
    "30m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=16384),
    "125m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    "500m": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
}  # fmt: skip
BUDGETS = (1024, 4096)
SEQ_LEN = 256  # the packed micro-batch holds budget // SEQ_LEN sequences of this length
SERVER = dict(concurrency=32, prompt_len=128, max_new_tokens=128)


def qwen2_config(size: str) -> dict:
    """An HF ``config.json`` mapping for a random Qwen2 shape."""
    return dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        **SHAPES[size],
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, so that a peak taken
    during imports or the warm-up (ru_maxrss is a lifetime mark) cannot count as the
    measured point's peak. Linux >= 4.0: writing 5 to clear_refs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    """The peak RSS since the last `_reset_peak` (VmHWM of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _hf_config(transformers, config: dict):
    cfg = transformers.Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    return cfg


def _warm_up(torch, transformers, chunked_logprobs_entropy) -> None:
    """One tiny training step first, so that lazily loaded kernels and modules sit in the
    baseline (what a trainer has loaded before its first real step)."""
    import gc

    tiny = dict(SHAPES["10m"], num_hidden_layers=1, vocab_size=256, intermediate_size=64)
    m = transformers.Qwen2ForCausalLM(_hf_config(transformers, qwen2_config("10m") | tiny))
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    ids = torch.randint(0, 256, (2, 16))
    h = m.model(input_ids=ids).last_hidden_state.reshape(32, -1)
    chunked_logprobs_entropy(h, m.lm_head.weight, None, ids.reshape(-1))[0].mean().backward()
    # what the server's sampling runs too (the fused head no longer does)
    x = torch.randn(4, 256, requires_grad=True)
    logp = torch.log_softmax(x, -1)
    logp.gather(-1, torch.zeros(4, 1, dtype=torch.long)).sum().backward()
    (logp.exp() * logp).sum(-1)
    opt.step()
    with torch.no_grad():
        m(input_ids=ids[:, :4], use_cache=True)
    del m, opt, h
    gc.collect()


def measure_point(point: dict) -> dict:
    """Run one measurement in this process (call it in a fresh subprocess)."""
    import torch
    import transformers

    from areal.engine.fsdp.logprob_head import chunked_logprobs_entropy
    from areal.inference.server.core import GenerationCore
    from areal.inference.server.requests import SamplingParams

    torch.set_num_threads(1)
    torch.manual_seed(0)
    _warm_up(torch, transformers, chunked_logprobs_entropy)
    base = _rss_bytes()
    _reset_peak()
    cfg = _hf_config(transformers, point["config"])
    model = transformers.Qwen2ForCausalLM(cfg).float()
    if point["kind"] == "train":
        if point.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        n, L = point["tokens"] // point["seq_len"], point["seq_len"]
        ids = torch.randint(0, cfg.vocab_size, (n, L))
        labels = torch.roll(ids, -1, dims=1).reshape(-1)
        t0 = time.perf_counter()
        for _ in range(2):  # the second step is the steady state: Adam states exist
            hidden = model.model(input_ids=ids).last_hidden_state.reshape(n * L, -1)
            logp, _ = chunked_logprobs_entropy(hidden, model.lm_head.weight, None, labels)
            (-logp.mean()).backward()
            del hidden, logp
            opt.step()
            opt.zero_grad(set_to_none=True)  # as FSDPEngine does
        secs = (time.perf_counter() - t0) / 2
    else:
        import threading

        c = point["concurrency"]
        core = GenerationCore(model, max_batch_size=c)
        done = threading.Semaphore(0)
        g = torch.Generator().manual_seed(1)
        # Held while the requests arrive, then admitted together: the estimate's worst case
        # (one admission of every prompt, then the full batch decoding). Submitted to a
        # running scheduler, the first admissions would take whatever had arrived, and the
        # peak would move with thread timing (125-173 MiB at 10M).
        core.pause().result()
        t0 = time.perf_counter()
        for i in range(c):
            prompt = torch.randint(0, cfg.vocab_size, (point["prompt_len"],), generator=g)
            sp = SamplingParams(max_new_tokens=point["max_new_tokens"], ignore_eos=True, seed=i)
            core.submit(f"r{i}", prompt.tolist(), sp, lambda _r: done.release())
        core.resume().result()
        for _ in range(c):
            done.acquire()
        secs = time.perf_counter() - t0
        core.shutdown()
    return {"measured_bytes": _peak_bytes() - base, "baseline_bytes": base, "seconds": secs}


def run_point(point: dict, timeout: float = 1800) -> dict:
    """Measure one point in a fresh subprocess (one torch thread)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--point", json.dumps(point)],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"measurement failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="30m,125m")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--point", default=None)
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()
    if args.point:
        print(json.dumps(measure_point(json.loads(args.point))))
        return
    from areal.utils import memory_plan as mp

    rows = []
    for size in args.sizes.split(","):
        cfg = qwen2_config(size)
        shape = mp.ModelShape.from_hf_config(cfg)
        for budget in map(int, args.budgets.split(",")):
            for gc in (False, True):
                est = mp.trainer_rank_memory(
                    shape, mp.TrainLayout(), tokens_per_mb=budget, gradient_checkpointing=gc,
                    optimizer="adam", param_bytes=4, compute_bytes=4,
                )  # fmt: skip
                pt = dict(kind="train", config=cfg, tokens=budget, seq_len=SEQ_LEN,
                          gradient_checkpointing=gc)  # fmt: skip
                m = run_point(pt)
                e = sum(est.values())
                rows.append(dict(size=size, n_params=shape.n_params(), kind="trainer", tokens_per_mb=budget,
                                 gradient_checkpointing=gc, estimate_mib=round(e / 2**20, 1),
                                 measured_mib=round(m["measured_bytes"] / 2**20, 1),
                                 ratio=round(e / m["measured_bytes"], 3), seconds=round(m["seconds"], 2),
                                 items_mib={k: round(v / 2**20, 1) for k, v in est.items()}))  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.no_server:
            continue
        est = mp.server_memory(shape, weight_bytes=4, kv_bytes=4, **SERVER)  # fmt: skip
        m = run_point(dict(kind="server", config=cfg, **SERVER))
        e = sum(est.values())
        rows.append(dict(size=size, n_params=shape.n_params(), kind="server", **SERVER,
                         estimate_mib=round(e / 2**20, 1), measured_mib=round(m["measured_bytes"] / 2**20, 1),
                         ratio=round(e / m["measured_bytes"], 3), seconds=round(m["seconds"], 2),
                         items_mib={k: round(v / 2**20, 1) for k, v in est.items()}))  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(
        json.dumps(
            {"points": rows, "worst_relative_error": round(worst, 3), "within_20pct": worst <= 0.2},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
