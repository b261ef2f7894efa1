"""Cost of the verified weight sync (``WeightFingerprintHook``) against a plain weight sync.

Real components, two identical stacks side by side: a train controller with one
FSDPEngine worker (LocalScheduler), one built-in server, ``disk`` weight updates through
``WeightSynchronizer``:

- ``plain``: synced without the hook (no digests in the export, no check);
- ``verified``: synced with ``WeightFingerprintHook(full_every, background)`` as the
  trainer configures it (``rollout.verify_weights_full_every`` / ``..._background``).

Each round syncs both (which goes first alternates, so load changes hit both alike); a
background check is waited for (``hook.flush``) before the next sync starts, and timed on
its own. Per sync, wall time and CPU time (this process, which runs the hook, plus the
stack's trainer worker and server) are measured. The JSON gives, averaged over all rounds
(whole rotations when ``--rounds`` is a multiple of ``--full-every``), as fractions of the
plain sync:

- ``added_wall_on_sync``: what verification adds to the sync's wall time (the mean of the
  paired differences verified - plain, with its standard error, and their median, which
  an occasional slow sync of either stack does not move; the check is on this path: the
  commit waits for it, ``areal.infra.weights.weight_sync``);
- ``check_wall``: the check's own wall time (part of the sync; the step-boundary
  ``flush`` timed on its own has nothing left to do); ``added_wall_sync_plus_check``: both
  (the check counted once);
- ``added_cpu``: all CPU time verification adds (digests in the export, the check in the
  trainer, the server and this process): (verified sync + check - plain sync) CPU;
- ``trainer_digest`` / ``server_digest``: the digests alone, timed where they run (less
  noisy than differences of syncs).

    .venv/bin/python benchmarks/bench_weight_fingerprint.py [--hidden 512 --layers 8]
        [--model areal/models/assets/tiny-base] [--rounds 32] [--full-every 8] [--inline]

Model: a random Qwen2 of the given size (default ~9M parameters, float32) or ``--model``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _model(path: str, hidden: int, layers: int) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _stack(root: str, model_dir: str):
    """(actor, engine, scheduler, meta) of one stack."""
    from _train_config import tiny_train_config

    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.infra.controller.train_controller import TrainController
    from areal.infra.scheduler.local import LocalScheduler

    os.makedirs(root, exist_ok=True)
    config = tiny_train_config(model_dir, experiment_name="bench")
    sched = LocalScheduler(fileroot=root, startup_timeout=300, call_timeout=600)
    actor = TrainController("areal.engine.fsdp_engine.FSDPEngine", config, sched)
    engine = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=300, request_timeout=600))
    actor.initialize(
        "actor",
        world_size=1,
        ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1),
    )
    engine.launch_server({"model_path": model_dir, "num_servers": 1})
    engine.initialize(train_data_parallel_size=1)
    meta = WeightUpdateMeta.from_disk("bench", "t", os.path.join(root, "wu"))
    actor.connect_engine(engine, meta)
    return actor, engine, sched, meta


def _close(stack) -> None:
    actor, engine, sched, _ = stack
    for fn in (engine.destroy, engine.teardown_server, actor.destroy, sched.close):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - best-effort teardown of a benchmark
            print(f"teardown: {type(e).__name__}: {e}", file=sys.stderr)


def _cpu(procs) -> float:
    """CPU seconds of this process and ``procs`` so far (every thread, ended ones too), in
    nanoseconds where Linux has the process CPU clocks (psutil's user + system time counts
    in 10 ms ticks, coarser than a small model's whole sync)."""
    import psutil

    total = time.process_time()
    for p in procs:
        try:  # the process-wide CPU clock of another process: MAKE_PROCESS_CPUCLOCK(pid, SCHED)
            total += time.clock_gettime(((~p.pid) << 3) | 2)
        except (OSError, OverflowError):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def _children(before: set[int]):
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
    return m, se


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", default="", help="an HF model directory instead of a random one")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--full-every", type=int, default=8)
    ap.add_argument("--inline", action="store_true", help="check inside the sync")
    ap.add_argument(
        "--no-in-response",
        action="store_true",
        help="ask the trainer and the servers with requests after the push (as for xccl)",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from areal.infra.weights.weight_sync import WeightSynchronizer
    from areal.infra.weights.weight_verify import WeightFingerprintHook

    root = tempfile.mkdtemp(prefix="bench-wfp-")
    if args.model:
        from safetensors.torch import load_file

        model_dir = args.model
        sd = load_file(os.path.join(model_dir, "model.safetensors"))
        n_params = sum(t.numel() for t in sd.values())
    else:
        model_dir = os.path.join(root, "model")
        n_params = _model(model_dir, args.hidden, args.layers)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(os.path.dirname(__file__), ".."), os.environ.get("PYTHONPATH")])
    )
    stacks = []
    extra = {"in_response": False} if args.no_in_response else {}
    hook = WeightFingerprintHook(full_every=args.full_every, background=not args.inline, **extra)
    try:
        import psutil

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        stacks.append(_stack(os.path.join(root, "plain"), model_dir))
        procs0 = _children(before)
        before |= {p.pid for p in procs0}
        stacks.append(_stack(os.path.join(root, "verified"), model_dir))
        procs1 = _children(before)
        (a0, e0, _, m0), (a1, e1, _, m1) = stacks
        plain = WeightSynchronizer(a0, e0, m0)
        checked = WeightSynchronizer(a1, e1, m1, hooks=[hook])
        res: dict[str, list[float]] = {}
        phases: list[dict] = []  # per sync: where its time went (to explain slow ones)

        def timed(fn, procs):
            c0, t0 = _cpu(procs), time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0, _cpu(procs) - c0

        def verified_round(version):
            _, wall, cpu = timed(lambda: checked.sync(version), procs1)
            stats: dict[str, float] = {}
            _, c_wall, c_cpu = timed(lambda: hook.flush(stats), procs1)  # background check
            return wall, cpu, c_wall, c_cpu, stats

        warmup = 2  # the first (inline) check and one background check
        for version in range(1, args.rounds + warmup + 1):
            if version % 2:  # alternate which goes first
                _, p_wall, p_cpu = timed(lambda v=version: plain.sync(v), procs0)
                v_wall, v_cpu, c_wall, c_cpu, stats = verified_round(version)
            else:
                v_wall, v_cpu, c_wall, c_cpu, stats = verified_round(version)
                _, p_wall, p_cpu = timed(lambda v=version: plain.sync(v), procs0)
            for m in (m0, m1):  # the previous version's weight directories (disk space)
                shutil.rmtree(m.with_version(version - 1).path, ignore_errors=True)
            if version <= warmup:
                continue
            # the check's stats: of the background check (flushed), else of the sync (inline,
            # or the fingerprints that came with the update)
            src = stats if "weight_sync/fingerprint_seconds" in stats else checked.last_stats
            for name, sync, wall in (("plain", plain, p_wall), ("verified", checked, v_wall)):
                answers = getattr(sync.rollout, "disk_update_responses", None) or {}
                phases.append(
                    {
                        "stack": name,
                        "version": version,
                        "seconds": round(wall, 4),
                        "push": round(sync.last_stats.get("weight_sync/push_seconds", 0.0), 4),
                        # of the push: the server's reload (its answer's time_s), the rest
                        # being the trainer's save and the requests
                        "server_load": round(
                            max((float(a.get("time_s", 0.0)) for a in answers.values()), default=0),
                            4,
                        ),
                        "pause": round(sync.last_stats.get("weight_sync/pause_seconds", 0.0), 4),
                    }
                )
            row = {
                "plain": p_wall,
                "verified": v_wall,
                "diff": v_wall - p_wall,
                "check": src.get("weight_sync/fingerprint_seconds", c_wall),
                "plain_cpu": p_cpu,
                "added_cpu": v_cpu + c_cpu - p_cpu,
                "server_digest": src.get("weight_sync/fingerprint_server_digest_seconds", 0.0),
                "in_response": src.get("weight_sync/fingerprint_in_response_servers", 0.0),
                "trainer_digest": a1.scheduler.call_engine("actor/0", "_export_digests").seconds,
            }
            for k, x in row.items():
                res.setdefault(k, []).append(x)
        mean = {k: statistics.fmean(x) for k, x in res.items()}
        p = mean["plain"]
        diff, diff_se = _mean_se(res["diff"])
        cpu_add, cpu_se = _mean_se(res["added_cpu"])

        def frac(x: float) -> float:
            return round(x / p, 4)

        print(
            json.dumps(
                {
                    "params": n_params,
                    "model": args.model or f"random Qwen2 hidden {args.hidden} x {args.layers}",
                    "weight_update_mode": "disk",
                    "mode": "inline" if args.inline else "background",
                    # servers whose fingerprint came with the update (no request), per sync
                    "in_response_servers_mean": mean["in_response"],
                    "full_every": args.full_every,
                    "rounds": args.rounds,
                    "plain_sync_seconds_mean": round(p, 4),
                    "plain_sync_seconds_median": round(statistics.median(res["plain"]), 4),
                    "verified_sync_seconds_mean": round(mean["verified"], 4),
                    "verified_sync_seconds_median": round(statistics.median(res["verified"]), 4),
                    # fractions of the plain sync's mean wall time (CPU: of its CPU time)
                    "added_wall_on_sync": frac(diff),
                    "added_wall_on_sync_stderr": frac(diff_se),
                    # robust to the occasional slow sync (page-cache writeback) of either stack
                    "added_wall_on_sync_median_paired": frac(statistics.median(res["diff"])),
                    "check_wall": frac(mean["check"]),
                    # what the run waits for in all: the check is inside the sync (the
                    # commit waits for it), so the sync's added wall time
                    "added_wall_sync_plus_check": frac(diff),
                    "check_seconds_mean": round(mean["check"], 4),
                    "plain_sync_cpu_seconds_mean": round(mean["plain_cpu"], 4),
                    "added_cpu": round(cpu_add / mean["plain_cpu"], 4),
                    "added_cpu_stderr": round(cpu_se / mean["plain_cpu"], 4),
                    "trainer_digest": frac(mean["trainer_digest"]),
                    "server_digest": frac(mean["server_digest"]),
                    "trainer_digest_seconds_max": round(max(res["trainer_digest"]), 4),
                    "plain_sync_seconds": [round(x, 4) for x in res["plain"]],
                    "verified_sync_seconds": [round(x, 4) for x in res["verified"]],
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                    # syncs over twice the median of their stack: push (save + reload) or
                    # the rest (pause, verification, versions, resume)?
                    "slow_syncs": [
                        ph
                        for ph in phases
                        if ph["seconds"] > 2 * statistics.median(res[ph["stack"]])
                    ],
                },
                indent=2,
            )
        )
    finally:
        for st in reversed(stacks):
            _close(st)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
