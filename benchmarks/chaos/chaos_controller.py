"""The controller the chaos soak runs: the CPU demo (GRPO) with a reward that can be made
to hang. While the file ``$AREAL_CHAOS_DIR/reward_hang`` exists every reward call blocks
(forever, as far as it knows); ``AsyncRewardWrapper`` must kill it, count 0, go on.

    python benchmarks/chaos/chaos_controller.py --config examples/math/gsm8k_grpo_cpu.yaml ...
"""

import os
import sys
import time

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.reward.gsm8k import gsm8k_reward_fn
from areal.utils.hf_utils import load_hf_tokenizer


def chaos_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kw):
    marker = os.path.join(os.environ.get("AREAL_CHAOS_DIR", "/nonexistent"), "reward_hang")
    while os.path.exists(marker):  # a reward that hangs
        time.sleep(0.5)
    return gsm8k_reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kw)


def main(args):
    config, _ = load_expr_config(args, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    with PPOTrainer(config, train_dataset=train_dataset) as trainer:
        trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=dict(
                reward_fn="chaos_controller.chaos_reward_fn",
                gconfig=config.gconfig,
                tokenizer=config.tokenizer_path,
                enable_thinking=False,
            ),
        )


if __name__ == "__main__":
    main(sys.argv[1:])
