"""The CPU demo as a module: ``python -m areal.demo`` (works from an installed wheel).

Asynchronous GRPO on the shipped tiny model (package data, ``areal/models/assets/tiny-base``)
with generated data (synthetic GSM8K-style word problems): one built-in inference server
and one FSDP training worker (gloo). The configuration is that of
``examples/math/gsm8k_grpo_cpu.yaml`` (``make demo``), with the model path pointing into
the installed package and its own experiment name, so it never resumes a ``make demo`` run.

    python -m areal.demo                       # 100 steps (about 8-10 min on 2 cores)
    python -m areal.demo --steps 3             # a quick check of an install
    python -m areal.demo --steps 3 --eval-n 64 --fileroot /tmp/areal-demo gconfig.n_samples=4

Extra ``key=value`` arguments are configuration overrides, as for the example script.
Rerunning the same command resumes from the last recover checkpoint (delete the
``--fileroot`` folder to start over).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

# The same settings as examples/math/gsm8k_grpo_cpu.yaml (tests/test_packaging.py checks
# that they agree), except experiment_name, actor.path (set at run time) and the sizes
# given on the command line.
DEMO_YAML = """\
experiment_name: areal-demo
trial_name: demo
seed: 1
total_train_epochs: 1
total_train_steps: 100
tokenizer_path: ${actor.path}
allocation_mode: local:d1+fsdp:d1
async_training: true

cluster:
  n_nodes: 1
  n_gpus_per_node: 0
  fileroot: ./outputs

scheduler:
  type: local

rollout:
  max_concurrent_rollouts: 64
  consumer_batch_size: ${train_dataset.batch_size}
  max_head_offpolicyness: 2
  request_timeout: 120
  setup_timeout: 120

gconfig:
  n_samples: 8
  max_new_tokens: 48
  greedy: false
  temperature: 1.0

eval_gconfig:
  n_samples: 1
  max_new_tokens: 48
  greedy: true

actor:
  path: TINY_BASE
  dtype: float32
  attn_impl: sdpa
  num_threads: 1
  weight_update_mode: disk
  mb_spec:
    max_tokens_per_mb: 8192
  optimizer:
    type: adam
    lr: 5.0e-5
    weight_decay: 0.0
    beta1: 0.9
    beta2: 0.99
    eps: 1.0e-8
    lr_scheduler_type: constant
    warmup_steps_proportion: 0.1
    gradient_clipping: 1.0
  group_size: ${gconfig.n_samples}
  ppo_n_minibatches: 2
  eps_clip: 0.2
  temperature: ${gconfig.temperature}
  kl_ctl: 0.0
  recompute_logprob: true
  use_decoupled_loss: true
  rejection_sampling:
    metric: ratio
    upper: 5.0
  dynamic_sampling: true
  reward_norm:
    mean_level: group
    std_level: group
    group_size: ${gconfig.n_samples}
  adv_norm: null

train_dataset:
  path: synthetic://arith?digits=1&steps=2&n=20000&seed=0
  type: rl
  batch_size: 16
  shuffle: true

valid_dataset:
  path: synthetic://arith?digits=1&steps=2&n=512&seed=12345
  type: rl
  batch_size: 128

saver:
  freq_epochs: null
  freq_steps: null

evaluator:
  eval_before_train: true  # held-out accuracy of the base model first
  freq_steps: 50

recover:
  mode: auto
  freq_steps: 25

stats_logger:
  wandb:
    mode: disabled
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m areal.demo",
        description="Asynchronous GRPO on the shipped tiny model, on the CPU.",
        epilog="Other arguments are config overrides (key.sub=value), "
        "e.g. rollout.max_head_offpolicyness=4.",
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    parser.add_argument(
        "--eval-n",
        type=int,
        default=512,
        help="held-out problems evaluated before and after training (default 512)",
    )
    parser.add_argument(
        "--fileroot", default="./outputs", help="where logs and checkpoints go (./outputs)"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the demo's YAML and exit"
    )
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments {bad}; overrides look like key.sub=value")
    if args.steps < 1:
        parser.error(f"--steps={args.steps}; must be >= 1")
    if args.eval_n < 1:
        parser.error(f"--eval-n={args.eval_n}; must be >= 1")
    return args, overrides


def build_config(argv: list[str]) -> Any:
    """The demo's ``GRPOConfig`` for these command-line arguments (loads nothing heavy)."""
    from areal.api.cli_args import GRPOConfig, load_expr_config
    from areal.models import get_tiny_base_path

    args, overrides = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "demo.yaml")
        with open(path, "w") as f:
            f.write(DEMO_YAML.replace("TINY_BASE", get_tiny_base_path()))
        cli = [
            "--config",
            path,
            f"total_train_steps={args.steps}",
            f"cluster.fileroot={os.path.abspath(args.fileroot)}",
            f"valid_dataset.path=synthetic://arith?digits=1&steps=2&n={args.eval_n}&seed=12345",
            f"valid_dataset.batch_size={min(128, args.eval_n)}",
            *overrides,
        ]
        config, _ = load_expr_config(cli, GRPOConfig)
    return config


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parse_args(argv)
    if args.print_config:
        sys.stdout.write(DEMO_YAML)
        return {}
    config = build_config(argv)

    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer
    from areal.utils.stats_logger import StatsLogger

    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid_dataset = get_custom_dataset("test", config.valid_dataset, tokenizer)
    log_path = StatsLogger.get_log_path(config.stats_logger)
    workflow_kwargs = dict(
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
        enable_thinking=False,
        dump_dir=os.path.join(log_path, "generated"),
    )
    eval_kwargs = dict(
        workflow_kwargs,
        gconfig=config.eval_gconfig,
        rollout_stat_scope="eval-rollout",
        dump_dir=os.path.join(log_path, "generated-eval"),
    )
    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        result = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=workflow_kwargs,
            eval_workflow="areal.workflow.rlvr.RLVRWorkflow",
            eval_workflow_kwargs=eval_kwargs,
        )

    before = result.get("initial_eval", {}).get("eval/accuracy")
    after = result.get("final_eval", {}).get("eval/accuracy")
    lines = ["=" * 72]
    if before is not None:
        lines.append(f"held-out accuracy before RL: {before:.3f}")
    if after is not None:
        lines.append(f"held-out accuracy after  RL: {after:.3f}  ({result['total_steps']} steps)")
    lines.append(f"curves: {os.path.join(result['log_dir'], 'curves.png')}")
    lines.append(f"stats:  {os.path.join(result['log_dir'], 'stats.jsonl')}")
    sys.stdout.write("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
