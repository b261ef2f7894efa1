"""Where the built-in server's time goes, in process (no HTTP): thread CPU seconds of the
generation core's parts for ``--prompts`` x ``--samples`` fixed-length answers, greedy and
sampled, each on a fresh core (no prompt LRU carried over). Prints JSON.

    .venv/bin/python benchmarks/profile_server_decode.py --size 125m
    py-spy record -f raw -o decode.txt -- .venv/bin/python benchmarks/profile_server_decode.py

``--size``: ``tiny-base`` or a random Qwen2 shape of ``bench_planner`` (``30m``, ``125m``),
the models ``bench_generation.py --vllm`` uses. Thread CPU time, so less sensitive to
other load than the wall clock (reported too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_generation import make_prompts, side_by_side_model  # noqa: E402

from areal.inference.server import core as core_mod  # noqa: E402


def _timed(acc: dict, key: str, fn):
    def wrapper(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.thread_time() - t0

    return wrapper


def profile(model, prompts, samples, max_new, greedy) -> dict:
    core = core_mod.GenerationCore(model, max_batch_size=128)
    acc: dict[str, float] = {}
    core._decode_step = _timed(acc, "decode_step", core._decode_step)
    core._admit = _timed(acc, "admission", core._admit)
    core._prefill = _timed(acc, "prefill", core._prefill)
    if core._fast is not None:
        core._fast.step = _timed(acc, "forward", core._fast.step)
    core._hf_decode = _timed(acc, "hf_forward", core._hf_decode)
    sample = core_mod.sample_tokens
    core_mod.sample_tokens = _timed(acc, "sampling", sample)
    done = threading.Semaphore(0)
    tokens = [0]

    def cb(res):
        tokens[0] += len(res.get("output_ids", []))
        done.release()

    sp = core_mod.SamplingParams(max_new_tokens=max_new, greedy=greedy, ignore_eos=True)
    jobs = [p for p in prompts for _ in range(samples)]
    core.pause().result()  # everything admitted together, as a burst of requests would be
    t0 = time.perf_counter()
    try:
        for i, p in enumerate(jobs):
            core.submit(str(i), p, sp, cb)
        core.resume()
        for _ in jobs:
            done.acquire()
    finally:
        wall = time.perf_counter() - t0
        core.shutdown()
        core_mod.sample_tokens = sample
    cpu = acc.get("decode_step", 0.0) + acc.get("admission", 0.0)
    return {
        "tokens": tokens[0],
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "tokens_per_cpu_s": round(tokens[0] / max(cpu, 1e-9), 1),
        "parts_cpu_s": {k: round(v, 2) for k, v in sorted(acc.items())},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="125m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="greedy,sampled")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, vocab = side_by_side_model(args.size, tmp)
        prompts = make_prompts(args.prompts, vocab, model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    report = {"size": args.size, "load_avg": os.getloadavg()}
    for mode in args.modes.split(","):
        report[mode] = profile(
            model, prompts, args.samples, args.max_new_tokens, greedy=mode == "greedy"
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
