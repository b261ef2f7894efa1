"""Cost of the verified weight sync (``WeightFingerprintHook``) against a plain weight sync.

Real components, two identical stacks side by side: a train controller with one
FSDPEngine worker (LocalScheduler), one built-in server, ``disk`` weight updates through
``WeightSynchronizer``.

- ``plain``: started with ``AREAL_WEIGHT_DIGESTS=0`` (no export/load-time digests), synced
  without the hook: the weight sync as it would be without verification;
- ``verified``: digests on (trainer export + server load), synced with the hook.

Each round syncs both (which goes first alternates), so load changes hit both alike. The JSON gives the
median sync of each, the overhead ``verified / plain - 1`` (everything the check adds:
digests in the export and the load, the check itself), the median check time alone
(``weight_sync/fingerprint_seconds``) and the median push times. On a busy machine the
difference of two noisy syncs is noisy too, so the same cost is also given by its
components, timed where they run: the digests in the trainer's export and in the
server's load, plus the check, over the plain sync.

    .venv/bin/python benchmarks/bench_weight_fingerprint.py [--hidden 512 --layers 8 --rounds 21]

Model: a random Qwen2 of the given size (default ~9M parameters, float32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

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


def _stack(root: str, model_dir: str, digests: bool):
    """(actor, engine, scheduler) of one stack; its processes see AREAL_WEIGHT_DIGESTS."""
    from areal.api.cli_args import (
        InferenceEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
    from areal.engine.local_remote import RemoteLocalEngine
    from areal.infra.controller.train_controller import TrainController
    from areal.infra.scheduler.local import LocalScheduler
    from areal.utils.weight_fingerprint import ENV_DIGESTS

    os.environ[ENV_DIGESTS] = "1" if digests else "0"
    os.makedirs(root, exist_ok=True)
    config = TrainEngineConfig(
        experiment_name="bench",
        trial_name="t",
        path=model_dir,
        dtype="float32",
        optimizer=OptimizerConfig(lr=1e-3),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=None),
        num_threads=1,
    )
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from areal.infra.weight_sync import WeightSynchronizer
    from areal.infra.weight_verify import WeightFingerprintHook

    root = tempfile.mkdtemp(prefix="bench-wfp-")
    model_dir = os.path.join(root, "model")
    n_params = _model(model_dir, args.hidden, args.layers)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(os.path.dirname(__file__), ".."), os.environ.get("PYTHONPATH")])
    )
    stacks = []
    try:
        stacks.append(_stack(os.path.join(root, "plain"), model_dir, digests=False))
        stacks.append(_stack(os.path.join(root, "verified"), model_dir, digests=True))
        (a0, e0, _, m0), (a1, e1, _, m1) = stacks
        plain = WeightSynchronizer(a0, e0, m0)
        checked = WeightSynchronizer(a1, e1, m1, hooks=[WeightFingerprintHook()])
        keys = ("plain", "verified", "check", "ct", "cs", "pp", "vp", "dt", "ds")
        res: dict[str, list[float]] = {k: [] for k in keys}
        for version in range(1, args.rounds + 2):
            if version % 2:  # alternate which goes first
                p = plain.sync(version)
                v = checked.sync(version)
            else:
                v = checked.sync(version)
                p = plain.sync(version)
            if version == 1:
                continue  # warm-up round
            res["plain"].append(p["weight_sync/seconds"])
            res["pp"].append(p["weight_sync/push_seconds"])
            res["verified"].append(v["weight_sync/seconds"])
            res["vp"].append(v["weight_sync/push_seconds"])
            res["check"].append(v["weight_sync/fingerprint_seconds"])
            res["ct"].append(v["weight_sync/fingerprint_trainer_seconds"])
            res["cs"].append(v["weight_sync/fingerprint_server_seconds"])
            # the digests' share of the push, timed inside the trainer and the server
            res["dt"].append(a1.scheduler.call_engine("actor/0", "_export_digests").seconds)
            res["ds"].append(v["weight_sync/fingerprint_server_digest_seconds"])
        med = {k: statistics.median(x) for k, x in res.items()}
        print(
            json.dumps(
                {
                    "params": n_params,
                    "weight_update_mode": "disk",
                    "rounds": args.rounds,
                    "plain_sync_seconds_median": round(med["plain"], 4),
                    "verified_sync_seconds_median": round(med["verified"], 4),
                    "overhead": round(med["verified"] / med["plain"] - 1, 4),
                    "check_seconds_median": round(med["check"], 4),
                    "check_over_plain_sync": round(med["check"] / med["plain"], 4),
                    "check_trainer_seconds_median": round(med["ct"], 4),
                    # components, timed where they run: the digests in the trainer's export
                    # and in the server's load, plus the check (less noisy than the
                    # difference of two syncs)
                    "trainer_digest_seconds_median": round(med["dt"], 4),
                    "server_digest_seconds_median": round(med["ds"], 4),
                    "components_over_plain_sync": round(
                        (med["dt"] + med["ds"] + med["check"]) / med["plain"], 4
                    ),
                    "check_server_seconds_median": round(med["cs"], 4),
                    "plain_push_seconds_median": round(med["pp"], 4),
                    "verified_push_seconds_median": round(med["vp"], 4),
                    "plain_sync_seconds": [round(x, 4) for x in res["plain"]],
                    "verified_sync_seconds": [round(x, 4) for x in res["verified"]],
                    "load_average": list(os.getloadavg()),
                },
                indent=2,
            )
        )
    finally:
        for st in reversed(stacks):
            _close(st)


if __name__ == "__main__":
    main()
