"""Asynchronous (eta=4) vs synchronous (eta=0) GRPO on the demo setup, same wall time.

    python benchmarks/bench_async_vs_sync.py [--seconds 150] [--eta 4]

Runs the CPU demo configuration (examples/math/gsm8k_grpo_cpu.yaml: 1 built-in server +
1 FSDP worker, tiny model) twice in this process, once with
rollout.max_head_offpolicyness=0 and once with eta, each for the same training wall time,
(at most --max-steps steps, which also sets the LR schedule), and prints JSON: trained tokens/s (tokens of consumed batches / training wall time),
steps, held-out greedy accuracy at the end, and the ratios. Target: >= 1.5x throughput at
no worse accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from areal import PPOTrainer  # noqa: E402
from areal.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal.dataset import get_custom_dataset  # noqa: E402
from areal.utils.hf_utils import load_hf_tokenizer  # noqa: E402


def run(eta: int, seconds: float, max_steps: int, fileroot: str, extra: list[str]) -> dict:
    cfg, _ = load_expr_config(
        [
            "--config", os.path.join(REPO, "examples/math/gsm8k_grpo_cpu.yaml"),
            f"actor.path={os.path.join(REPO, 'areal/models/assets/tiny-base')}",
            f"cluster.fileroot={fileroot}",
            f"trial_name=eta{eta}",
            f"rollout.max_head_offpolicyness={eta}",
            f"total_train_steps={max_steps}",
            "evaluator.freq_steps=null",
            "recover.mode=disabled",
            *extra,
        ],
        GRPOConfig,
    )  # fmt: skip
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    valid = get_custom_dataset("test", cfg.valid_dataset, tok)
    kwargs = dict(
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=cfg.gconfig,
        tokenizer=cfg.tokenizer_path,
    )
    eval_kwargs = dict(kwargs, gconfig=cfg.eval_gconfig, rollout_stat_scope="eval-rollout")
    with PPOTrainer(cfg, train_dataset=train, valid_dataset=valid) as trainer:
        res = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=kwargs,
            eval_workflow="areal.workflow.rlvr.RLVRWorkflow",
            eval_workflow_kwargs=eval_kwargs,
            max_seconds=seconds,
        )
        rows = [r for r in trainer.stats_logger.history if r["global_step"] >= 0]
    tokens = sum(r["batch/seq_len"] * r["batch/n_seqs"] for r in rows)
    gen_tokens = sum(r["batch/gen_len"] * r["batch/n_seqs"] for r in rows)
    return {
        "eta": eta,
        "steps": len(rows),
        "train_seconds": round(res["train_seconds"], 1),
        "trained_tokens_per_sec": round(tokens / res["train_seconds"], 1),
        "trained_generated_tokens_per_sec": round(gen_tokens / res["train_seconds"], 1),
        "samples_per_sec": round(sum(r["batch/n_seqs"] for r in rows) / res["train_seconds"], 2),
        "mean_staleness": round(
            sum(r.get("staleness/avg", 0.0) for r in rows) / max(len(rows), 1), 3
        ),
        "accuracy_before": res["initial_eval"]["eval/accuracy"],
        "accuracy_after": res["final_eval"]["eval/accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150.0, help="training wall time per mode")
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument(
        "--max-steps",
        type=int,
        default=100,
        help="total_train_steps of both runs (sets the LR schedule; a run may stop earlier on time)",
    )
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        sync = run(0, args.seconds, args.max_steps, root, args.overrides)
        asyn = run(args.eta, args.seconds, args.max_steps, root, args.overrides)
    out = {
        "benchmark": "async_vs_sync",
        "setup": "demo config, 1 built-in server + 1 FSDP worker (gloo), tiny model, 2 CPU cores",
        "baseline": "eta=0 (synchronous), same wall time",
        "sync": sync,
        "async": asyn,
        "throughput_ratio": round(
            asyn["trained_tokens_per_sec"] / sync["trained_tokens_per_sec"], 3
        ),
        "accuracy_delta": round(asyn["accuracy_after"] - sync["accuracy_after"], 4),
        "target_throughput_ratio": 1.5,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
