"""The throughput cost of ``deterministic: true`` on the demo setup (eta = 2).

    python benchmarks/bench_deterministic.py [--steps 8] [--batch-size 16] [--n-samples 8]

Runs the CPU demo configuration (examples/math/gsm8k_grpo_cpu.yaml: 1 built-in server +
1 FSDP worker, tiny model; no evaluation) twice in this process with the same settings,
once with ``deterministic=false`` and once with ``deterministic=true``, and prints JSON:
trained samples/s (sequences of consumed batches / training wall time from the first
step), trained tokens/s, the mean seconds per step of each phase (``time/rollout`` is
the wait for a batch; ``time/wait_pinned_rollouts`` the deterministic run's wait for the
waves pinned to the current version before each weight push), and the ratio
deterministic / non-deterministic of trained samples/s.

Where the cost comes from (docs/best_practices/reproducibility.md): deterministic
requests run one per forward on the server (no batching), the waves of one batch run one
after the other in rounds, and a weight push waits for the wave it pins.
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

PHASES = ["rollout", "compute_logp", "train_step", "wait_pinned_rollouts", "update_weights"]


def run(deterministic: bool, args: argparse.Namespace, fileroot: str) -> dict:
    cfg, _ = load_expr_config(
        [
            "--config", os.path.join(REPO, "examples/math/gsm8k_grpo_cpu.yaml"),
            f"actor.path={os.path.join(REPO, 'areal/models/assets/tiny-base')}",
            f"cluster.fileroot={fileroot}",
            f"trial_name={'det' if deterministic else 'nondet'}",
            f"deterministic={str(deterministic).lower()}",
            f"rollout.max_head_offpolicyness={args.eta}",
            f"total_train_steps={args.steps}",
            f"train_dataset.batch_size={args.batch_size}",
            f"gconfig.n_samples={args.n_samples}",
            f"gconfig.max_new_tokens={args.max_new_tokens}",
            "valid_dataset=null",
            "evaluator.eval_before_train=false",
            "recover.mode=disabled",
        ],
        GRPOConfig,
    )  # fmt: skip
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    kwargs = dict(
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=cfg.gconfig,
        tokenizer=cfg.tokenizer_path,
    )
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        res = trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=kwargs)
        rows = [r for r in trainer.stats_logger.history if r["global_step"] >= 0]
    seconds = res["train_seconds"]
    n_seqs = sum(r["batch/n_seqs"] for r in rows)
    tokens = sum(r["batch/seq_len"] * r["batch/n_seqs"] for r in rows)
    return {
        "deterministic": deterministic,
        "steps": len(rows),
        "train_seconds": round(seconds, 2),
        "trained_samples_per_sec": round(n_seqs / seconds, 3),
        "trained_tokens_per_sec": round(tokens / seconds, 1),
        "losses": [r["loss"] for r in rows],
        "step_seconds_by_phase": {
            p: round(sum(r.get(f"time/{p}", 0.0) for r in rows) / max(len(rows), 1), 3)
            for p in PHASES
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16, help="groups per batch (demo: 16)")
    ap.add_argument("--n-samples", type=int, default=8, help="group size (demo: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="demo: 48")
    ap.add_argument("--fileroot", default=None, help="default: a temporary directory")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.fileroot or tmp
        nondet = run(False, args, os.path.join(root, "nondet"))
        det = run(True, args, os.path.join(root, "det"))
    out = {
        "config": {
            "eta": args.eta,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "n_samples": args.n_samples,
            "max_new_tokens": args.max_new_tokens,
        },
        "non_deterministic": nondet,
        "deterministic": det,
        "samples_per_sec_ratio_det_over_nondet": round(
            det["trained_samples_per_sec"] / nondet["trained_samples_per_sec"], 3
        ),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
