"""GRPO on GSM8K-format math: the same script runs the CPU demo and the GPU recipe.

    python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo_cpu.yaml   # CPU demo
    python examples/math/gsm8k_rl.py --config examples/math/gsm8k_grpo.yaml       # GPU node

Overrides: ``key.sub=value`` (e.g. ``total_train_steps=20 rollout.max_head_offpolicyness=0``).
"""

import os
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import default_reward_fn, get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer
from areal.utils.stats_logger import StatsLogger


def main(args):
    config, _ = load_expr_config(args, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)

    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid_dataset = (
        get_custom_dataset("test", config.valid_dataset, tokenizer)
        if config.valid_dataset is not None
        else None
    )

    log_path = StatsLogger.get_log_path(config.stats_logger)
    workflow_kwargs = dict(
        # GSM8K's reward; a reasoning_gym:// dataset's own score_answer
        reward_fn=default_reward_fn(config.train_dataset.path),
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
        enable_thinking=False,
        dump_dir=os.path.join(log_path, "generated"),
    )
    eval_workflow_kwargs = workflow_kwargs.copy()
    eval_workflow_kwargs["gconfig"] = config.eval_gconfig
    if config.valid_dataset is not None:
        eval_workflow_kwargs["reward_fn"] = default_reward_fn(config.valid_dataset.path)
    eval_workflow_kwargs["rollout_stat_scope"] = "eval-rollout"
    eval_workflow_kwargs["dump_dir"] = os.path.join(log_path, "generated-eval")

    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        result = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=workflow_kwargs,
            eval_workflow="areal.workflow.rlvr.RLVRWorkflow",
            eval_workflow_kwargs=eval_workflow_kwargs,
        )

    before = result.get("initial_eval", {}).get("eval/accuracy")
    after = result.get("final_eval", {}).get("eval/accuracy")
    print("=" * 72)
    if before is not None:
        print(f"held-out accuracy before RL: {before:.3f}")
    if after is not None:
        print(f"held-out accuracy after  RL: {after:.3f}  ({result['total_steps']} steps)")
    print(f"curves: {os.path.join(result['log_dir'], 'curves.png')}")
    print(f"stats:  {os.path.join(result['log_dir'], 'stats.jsonl')}")


if __name__ == "__main__":
    main(sys.argv[1:])
