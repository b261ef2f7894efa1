"""Cost curves from ~1M to ~0.5B parameters (random-init Qwen2, fp32, CPU), as one JSON
object plus a log-log plot.

Parts (``--parts``, comma-separated):

- ``train``: per size, one FSDPEngine rank (``--ranks 2`` for two gloo ranks) trains a
  packed micro-batch of ``--tokens`` tokens: step time (the second step, Adam states
  exist), peak RSS above the post-import baseline (``VmHWM`` reset after a warm-up, the
  method of ``bench_planner.py``), bytes per parameter against the 16 bytes/param of fp32
  Adam training (parameters + gradients + two Adam moments) plus the planner's
  activation estimate; then one weight sync of each transport: ``disk`` (gather +
  safetensors write on the trainer, then ``load_weights_from_disk`` into a serving copy)
  and ``xccl`` over gloo (gather + broadcast to a receiver process, buckets of 256 MB).
- ``server``: per size, the built-in server's ``GenerationCore`` generating
  ``concurrency x max_new_tokens`` tokens: generated tokens/s, peak RSS, and the KV cache
  (measured peak minus the fp32 weights, next to the planner's KV-cache estimate).
- ``demo``: the demo model's shape (tiny-base, random weights): trainer step time and
  generation time against group size (answer 128 tokens), answer length (group 8), and
  number of servers (1 or 2 processes sharing one batch of 16 x 128 tokens).

Each curve's exponent is the least-squares slope of log(cost) against log(x).

Usage: ``nice -n 10 .venv/bin/python benchmarks/bench_scaling.py [--sizes 1m,30m,125m]
[--parts train,server,demo] [--ranks 1] [--out outputs/scaling]`` (500M: ~10 GB RAM;
run it alone). Writes ``scaling.json`` and ``scaling.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_planner as bp  # noqa: E402

SHAPES = {
    "1m": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
    **{k: bp.SHAPES[k] for k in ("30m", "125m", "500m")},
}  # fmt: skip
SEQ_LEN = 128
SERVER = dict(concurrency=8, prompt_len=64, max_new_tokens=64)
DEMO_PROMPT = 32
DEMO_GROUPS = (4, 8, 16, 32)
DEMO_LENGTHS = (32, 128, 512, 1024)
ADAM_FP32_BYTES_PER_PARAM = 16


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of log(y) on log(x): the exponent k of y ~ x**k."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        raise ValueError(f"need >= 2 positive points for a slope, got {len(pts)}")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        raise ValueError("all x values are equal; no slope")
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def model_config(size: str) -> dict:
    """The HF config mapping of a size name (``bench_planner.qwen2_config`` shapes)."""
    if size == "demo":
        from areal.models import get_tiny_base_path

        with open(os.path.join(get_tiny_base_path(), "config.json")) as f:
            cfg = json.load(f)
        return dict(cfg, max_position_embeddings=2048)
    if size not in SHAPES:
        raise ValueError(f"size={size!r}; allowed: {sorted(SHAPES)} or 'demo'")
    bp.SHAPES.setdefault(size, SHAPES[size])
    return bp.qwen2_config(size)


def _save(cfg: dict, path: str) -> str:
    import transformers

    bp._hf_config(transformers, cfg).save_pretrained(path)
    return path


class _FakeServer:
    """Rank 0's inference engine: disk updates return at once; xccl updates hand the
    bucket specs to the receiver process and wait for its acknowledgement."""

    def __init__(self, q_specs, q_ack):
        self.q_specs, self.q_ack = q_specs, q_ack

    @staticmethod
    def _done(value=None):
        from concurrent.futures import Future

        f = Future()
        f.set_result(value)
        return f

    def update_weights_from_disk(self, meta):
        return self._done()

    def init_weights_update_group(self, meta):
        self.q_specs.put(("init", meta.master_port, meta.world_size, meta.group_name))
        return self._done()

    def update_weights_from_distributed(self, meta, specs):
        from concurrent.futures import Future

        self.q_specs.put(("bucket", [s.to_dict() for s in specs]))
        f = Future()
        threading.Thread(target=lambda: f.set_result(self.q_ack.get()), daemon=True).start()
        return f


def _batch(torch, vocab: int, n: int, length: int, prompt: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, :prompt] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def _train_rank(rank, world, path, tokens, sync, wu_port, q_specs, q_ack) -> dict:
    import bench_train_engine as bte
    import torch
    import transformers

    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
    from areal.engine.fsdp import FSDPEngine
    from areal.engine.fsdp.logprob_head import chunked_logprobs_entropy

    bp._warm_up(torch, transformers, chunked_logprobs_entropy)
    base = bp._rss_bytes()
    bp._reset_peak()
    eng = FSDPEngine(bte._config(path, tokens))
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 100, 1))
    mem = {"init_peak": bp._peak_bytes() - base, "after_init": bp._rss_bytes() - base}
    bp._reset_peak()  # the training peak from here (VmHWM restarts at the current RSS)
    n_params = sum(p.numel() for p in eng.model.parameters()) * world  # sharded
    vocab = _vocab(path)
    batch = _batch(torch, vocab, max(1, tokens // SEQ_LEN), SEQ_LEN, 16, seed=rank)
    times = []
    for _ in range(2):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        eng.train_batch(batch, bte._loss_fn, bte._weight_fn)
        times.append(time.perf_counter() - t0)
    res = {"n_params": n_params, "step_s": round(times[-1], 3), "first_step_s": round(times[0], 3)}
    res["peak_rss_bytes"] = max(bp._peak_bytes() - base, mem["init_peak"])
    res["memory_mib"] = {
        "init_peak": round(mem["init_peak"] / 2**20, 1),
        "after_init": round(mem["after_init"] / 2**20, 1),
        "train_peak": round((bp._peak_bytes() - base) / 2**20, 1),
        "after_steps": round((bp._rss_bytes() - base) / 2**20, 1),
    }
    if not sync:
        eng.destroy()
        return res
    from areal.inference.server.weights import load_weights_from_disk

    if rank == 0:
        eng.connect_engine(_FakeServer(q_specs, q_ack), None)
    out = os.path.join(os.path.dirname(path), "wu_disk")
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.update_weights(WeightUpdateMeta(type="disk", path=out, version=1))
    res["disk_push_s"] = round(time.perf_counter() - t0, 3)
    if rank == 0:
        serving = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(path)
        )
        t0 = time.perf_counter()
        load_weights_from_disk(serving, out)
        res["disk_load_s"] = round(time.perf_counter() - t0, 3)
        res["disk_sync_s"] = round(res["disk_push_s"] + res["disk_load_s"], 3)
        del serving
    xmeta = WeightUpdateMeta(
        type="xccl", master_port=wu_port, world_size=2, weight_chunked_mem_mb=256
    )
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.update_weights(xmeta)  # joins the group first
    res["xccl_first_sync_s"] = round(time.perf_counter() - t0, 3)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    eng.update_weights(xmeta)
    res["xccl_sync_s"] = round(time.perf_counter() - t0, 3)
    if rank == 0:
        q_specs.put(("done",))
    eng.destroy()
    return res


def _vocab(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def train_size(size: str, tmp: str, tokens: int, ranks: int, sync: bool) -> dict:
    import multiprocessing as mp

    import bench_train_engine as bte

    from areal.utils import memory_plan as plan

    cfg = model_config(size)
    path = _save(cfg, os.path.join(tmp, size, "model"))
    ctx = mp.get_context("spawn")
    qs, qa = ctx.Queue(), ctx.Queue()
    port = bte._free_port()
    jobs = [
        (r, _train_rank, (r, ranks, path, tokens, sync, port, qs, qa), True) for r in range(ranks)
    ]
    if sync:
        jobs.append(("recv", bte._receiver, (qs, qa), False))
    out = bte._run(jobs, ranks, timeout=3600)
    shape = plan.ModelShape.from_hf_config(cfg)
    est = plan.trainer_rank_memory(
        shape, plan.TrainLayout(dp=ranks) if ranks > 1 else plan.TrainLayout(),
        tokens_per_mb=tokens, gradient_checkpointing=False, optimizer="adam",
    )  # fmt: skip
    n = out[0]["n_params"]
    peak = max(out[r]["peak_rss_bytes"] for r in range(ranks))
    expect = ADAM_FP32_BYTES_PER_PARAM * n // ranks + est["activations"]
    row = dict(out[0], size=size, ranks=ranks, tokens_per_rank=tokens)
    row.pop("peak_rss_bytes")
    row |= {
        "step_s": max(out[r]["step_s"] for r in range(ranks)),
        "peak_rss_mib": round(peak / 2**20, 1),
        "bytes_per_param": round(peak * ranks / n, 2),
        "expected_mib": round(expect / 2**20, 1),
        "activations_estimate_mib": round(est["activations"] / 2**20, 1),
        "planner_estimate_mib": round(sum(est.values()) / 2**20, 1),
        "measured_over_expected": round(peak / expect, 3),
    }
    return row


def server_size(size: str, **point) -> dict:
    from areal.utils import memory_plan as plan

    cfg = model_config(size)
    shape = plan.ModelShape.from_hf_config(cfg)
    point = SERVER | point
    m = bp.run_point(dict(kind="server", config=cfg, **point), timeout=3600)
    est = plan.server_memory(shape, weight_bytes=4, kv_bytes=4, **point)
    gen = point["concurrency"] * point["max_new_tokens"]
    return dict(
        size=size, n_params=shape.n_params(), **point, seconds=round(m["seconds"], 3),
        tokens_per_s=round(gen / m["seconds"], 1),
        peak_rss_mib=round(m["measured_bytes"] / 2**20, 1),
        kv_measured_mib=round((m["measured_bytes"] - est["weights"]) / 2**20, 1),
        kv_estimate_mib=round(est["kv cache"] / 2**20, 2),
    )  # fmt: skip


def _demo_train_rank(rank, world, path, points) -> list[dict]:
    import bench_train_engine as bte
    import torch

    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp import FSDPEngine

    eng = FSDPEngine(bte._config(path, 16384))
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 100, 1))
    vocab = _vocab(path)
    rows = []
    for g, length in points:
        batch = _batch(torch, vocab, g, DEMO_PROMPT + length, DEMO_PROMPT, seed=g + length)
        eng.train_batch(batch, bte._loss_fn, bte._weight_fn)  # warm-up at this shape
        best = float("inf")
        for _ in range(2):  # the faster of two: the machine is shared
            t0 = time.perf_counter()
            eng.train_batch(batch, bte._loss_fn, bte._weight_fn)
            best = min(best, time.perf_counter() - t0)
        rows.append({"group": g, "answer_len": length, "train_s": round(best, 3)})
    eng.destroy()
    return rows


def demo_curves(tmp: str) -> dict:
    import bench_train_engine as bte

    cfg = model_config("demo")
    path = _save(cfg, os.path.join(tmp, "demo", "model"))
    points = [(g, 128) for g in DEMO_GROUPS] + [(8, n) for n in DEMO_LENGTHS if n != 128]
    train = {(r["group"], r["answer_len"]): r["train_s"] for r in bte._run(
        [(0, _demo_train_rank, (0, 1, path, points), True)], 1, timeout=3600)[0]}  # fmt: skip
    rows = []
    for g, length in points:
        gen = server_size("demo", concurrency=g, prompt_len=DEMO_PROMPT, max_new_tokens=length)
        t = train[(g, length)]
        rows.append(dict(group=g, answer_len=length, train_s=t, generate_s=gen["seconds"],
                         step_s=round(t + gen["seconds"], 3)))  # fmt: skip
    servers = demo_servers(tmp)
    group = [r for r in rows if r["answer_len"] == 128]
    length = sorted((r for r in rows if r["group"] == 8), key=lambda r: r["answer_len"])
    return {
        "points": rows,
        "servers": servers,
        "exponents": {
            "step_vs_group": round(loglog_slope([r["group"] for r in group], [r["step_s"] for r in group]), 3),
            "train_vs_group": round(loglog_slope([r["group"] for r in group], [r["train_s"] for r in group]), 3),
            "step_vs_answer_len": round(loglog_slope([r["answer_len"] for r in length], [r["step_s"] for r in length]), 3),
            "train_vs_answer_len": round(loglog_slope([r["answer_len"] for r in length], [r["train_s"] for r in length]), 3),
            "generate_vs_servers": servers_exponent(servers),
        },
    }  # fmt: skip


def serve_point(point: dict) -> dict:
    """One server process of the multi-server point: build the core, warm up, report
    ready (a file), wait for the go file, then time ``concurrency`` requests."""
    import torch
    import transformers

    from areal.inference.server.core import GenerationCore
    from areal.inference.server.requests import SamplingParams

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = bp._hf_config(transformers, point["config"])
    core = GenerationCore(transformers.Qwen2ForCausalLM(cfg).float(), max_batch_size=64)
    done = threading.Semaphore(0)
    g = torch.Generator().manual_seed(point["seed"])

    def run(n: int, new: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            prompt = torch.randint(3, cfg.vocab_size, (point["prompt_len"],), generator=g)
            sp = SamplingParams(max_new_tokens=new, ignore_eos=True, seed=i)
            core.submit(f"r{i}-{new}", prompt.tolist(), sp, lambda _r: done.release())
        for _ in range(n):
            done.acquire()
        return time.perf_counter() - t0

    run(2, 8)  # warm-up
    open(point["ready"], "w").close()
    deadline = time.monotonic() + 600
    while not os.path.exists(point["go"]):
        if time.monotonic() > deadline:
            raise TimeoutError("no go file within 600 s")
        time.sleep(0.01)
    secs = run(point["concurrency"], point["max_new_tokens"])
    core.shutdown()
    return {"seconds": secs}


def demo_servers(tmp: str, samples: int = 16, answer_len: int = 128) -> list[dict]:
    """``samples`` requests split over 1 and 2 server processes that start generating
    together (each warmed up first); the wall time is the slower server's."""
    import subprocess

    cfg = model_config("demo")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    rows = []
    for n in (1, 2):
        d = tempfile.mkdtemp(dir=tmp, prefix=f"servers{n}_")
        go = os.path.join(d, "go")
        procs = []
        for i in range(n):
            pt = dict(config=cfg, concurrency=samples // n, prompt_len=DEMO_PROMPT,
                      max_new_tokens=answer_len, seed=i, ready=os.path.join(d, f"ready{i}"), go=go)  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve-point", json.dumps(pt)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env))  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while not all(os.path.exists(os.path.join(d, f"ready{i}")) for i in range(n)):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"{n} servers did not get ready")
                time.sleep(0.05)
            open(go, "w").close()
            secs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])["seconds"]
                    for p in procs]  # fmt: skip
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        rows.append(dict(servers=n, samples=samples, answer_len=answer_len,
                         generate_s=round(max(secs), 3), per_server_s=[round(x, 3) for x in secs]))  # fmt: skip
    return rows


def servers_exponent(servers: list[dict]) -> float:
    return round(
        loglog_slope([s["servers"] for s in servers], [s["generate_s"] for s in servers]), 3
    )


def size_exponents(train: list[dict], server: list[dict]) -> dict:
    out = {}
    one = [r for r in train if r["ranks"] == min(r["ranks"] for r in train)] if train else []
    if len(one) >= 2:
        n = [r["n_params"] for r in one]
        for key in ("step_s", "peak_rss_mib", "disk_sync_s", "xccl_sync_s"):
            if all(key in r for r in one):
                out[f"{key}_vs_params"] = round(loglog_slope(n, [r[key] for r in one]), 3)
    if len(server) >= 2:
        n = [r["n_params"] for r in server]
        out["tokens_per_s_vs_params"] = round(
            loglog_slope(n, [r["tokens_per_s"] for r in server]), 3
        )
        out["server_peak_rss_vs_params"] = round(loglog_slope(n, [r["peak_rss_mib"] for r in server]), 3)  # fmt: skip
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    train = [r for r in result.get("train", []) if r["ranks"] == 1]
    ax = axes[0]
    for key, label in (("step_s", "train step (s)"), ("disk_sync_s", "disk sync (s)"),
                       ("xccl_sync_s", "gloo sync (s)"), ("peak_rss_gib", "trainer peak RSS (GiB)")):  # fmt: skip
        pts = [
            (r["n_params"], r["peak_rss_mib"] / 1024 if key == "peak_rss_gib" else r.get(key))
            for r in train
        ]
        pts = [p for p in pts if p[1]]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", label=label)
    srv = result.get("server", [])
    if srv:
        ax.plot([r["n_params"] for r in srv], [r["tokens_per_s"] / 100 for r in srv], "s--",
                label="server tokens/s / 100")  # fmt: skip
    ax.set(
        xscale="log", yscale="log", xlabel="parameters", title="cost vs model size (fp32, 1 thread)"
    )
    if train or srv:
        ax.legend(fontsize=7)
    demo = result.get("demo")
    if demo:
        for ax, key, title in (
            (axes[1], "group", "demo: answer 128"),
            (axes[2], "answer_len", "demo: group 8"),
        ):
            other = "answer_len" if key == "group" else "group"
            fixed = 128 if key == "group" else 8
            rows = sorted((r for r in demo["points"] if r[other] == fixed), key=lambda r: r[key])
            for k in ("step_s", "train_s", "generate_s"):
                ax.plot([r[key] for r in rows], [r[k] for r in rows], "o-", label=k)
            ax.set(
                xscale="log",
                yscale="log",
                xlabel=key.replace("_", " "),
                ylabel="seconds",
                title=title,
            )
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1m,30m,125m", help="of " + ",".join(SHAPES))
    ap.add_argument(
        "--parts", default="train,server,demo", help="of train,server,demo,demo-servers"
    )
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per train step")
    ap.add_argument("--ranks", type=int, default=1, help="FSDP ranks (gloo) for the train part")
    ap.add_argument("--no-sync", action="store_true", help="skip the weight-sync timings")
    ap.add_argument("--out", default="outputs/scaling")
    ap.add_argument("--serve-point", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--merge", default=None, help="an earlier scaling.json to add rows to")
    args = ap.parse_args(argv)
    if args.serve_point:
        print(json.dumps(serve_point(json.loads(args.serve_point))))
        return
    parts = set(args.parts.split(","))
    if parts - {"train", "server", "demo", "demo-servers"}:
        ap.error(f"--parts={args.parts!r}; allowed: train, server, demo, demo-servers")
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        model_config(s)  # validates the name
    from areal.utils.cpu_info import cpu_kind

    result = {"train": [], "server": []}
    if args.merge and os.path.exists(args.merge):
        with open(args.merge) as f:
            result = json.load(f)
    result |= {"cpu": cpu_kind(), "dtype": "float32", "torch_threads": 1}
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for size in sizes:
            if "train" in parts:
                row = train_size(size, tmp, args.tokens, args.ranks, not args.no_sync)
                result["train"] = [r for r in result["train"] if (r["size"], r["ranks"]) != (size, args.ranks)] + [row]  # fmt: skip
                print(json.dumps(row), file=sys.stderr, flush=True)
            if "server" in parts:
                row = server_size(size)
                result["server"] = [r for r in result["server"] if r["size"] != size] + [row]
                print(json.dumps(row), file=sys.stderr, flush=True)
        if "demo" in parts:
            result["demo"] = demo_curves(tmp)
            print(json.dumps(result["demo"]), file=sys.stderr, flush=True)
        elif "demo-servers" in parts and "demo" in result:  # re-measure the servers only
            result["demo"]["servers"] = demo_servers(tmp)
            result["demo"]["exponents"]["generate_vs_servers"] = servers_exponent(
                result["demo"]["servers"]
            )
    result["train"].sort(key=lambda r: (r["ranks"], r["n_params"]))
    result["server"].sort(key=lambda r: r["n_params"])
    result["exponents"] = size_exponents(result["train"], result["server"])
    tr = [r["measured_over_expected"] for r in result["train"]]
    result["trainer_memory_within_25pct"] = bool(tr) and all(0.75 <= x <= 1.25 for x in tr)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "scaling.png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
