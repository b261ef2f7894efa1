"""Cost of the weight fingerprint check (``WeightFingerprintHook``) against a weight sync.

Real components: a train controller with one FSDPEngine worker (LocalScheduler), one
built-in server, ``disk`` weight updates through ``WeightSynchronizer``. Each round syncs
once without the hook and once with it (same weights); the JSON gives the median sync
time, the median fingerprint time (trainer and server side, both ways), and the ratio.

    .venv/bin/python benchmarks/bench_weight_fingerprint.py [--hidden 256 --layers 4 --rounds 3]

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
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
    from areal.infra.weight_sync import WeightSynchronizer
    from areal.infra.weight_verify import WeightFingerprintHook

    root = tempfile.mkdtemp(prefix="bench-wfp-")
    model_dir = os.path.join(root, "model")
    n_params = _model(model_dir, args.hidden, args.layers)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(os.path.dirname(__file__), ".."), os.environ.get("PYTHONPATH")])
    )
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
    try:
        actor.initialize(
            "actor",
            world_size=1,
            ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1),
        )
        engine.launch_server({"model_path": model_dir, "num_servers": 1})
        engine.initialize(train_data_parallel_size=1)
        meta = WeightUpdateMeta.from_disk("bench", "t", os.path.join(root, "wu"))
        actor.connect_engine(engine, meta)
        plain = WeightSynchronizer(actor, engine, meta)
        checked = WeightSynchronizer(actor, engine, meta, hooks=[WeightFingerprintHook()])
        sync_s, fp_s = [], []
        version = 0
        for _ in range(args.rounds):
            version += 1
            sync_s.append(plain.sync(version)["weight_sync/seconds"])
            version += 1
            fp_s.append(checked.sync(version)["weight_sync/fingerprint_seconds"])
        med_sync, med_fp = statistics.median(sync_s), statistics.median(fp_s)
        print(
            json.dumps(
                {
                    "params": n_params,
                    "weight_update_mode": "disk",
                    "rounds": args.rounds,
                    "sync_seconds_median": round(med_sync, 4),
                    "fingerprint_seconds_median": round(med_fp, 4),
                    "fingerprint_over_sync": round(med_fp / med_sync, 4),
                    "sync_seconds": [round(x, 4) for x in sync_s],
                    "fingerprint_seconds": [round(x, 4) for x in fp_s],
                },
                indent=2,
            )
        )
    finally:
        engine.destroy()
        engine.teardown_server()
        actor.destroy()
        sched.close()


if __name__ == "__main__":
    main()
