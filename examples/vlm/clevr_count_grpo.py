"""GRPO on image counting (CLEVR-Count): the CPU demo on the tiny VLM, or a GPU recipe.

    python examples/vlm/clevr_count_grpo.py --config examples/vlm/clevr_count_grpo_cpu.yaml
    # controls: reward values permuted within each batch / rewards at random
    python examples/vlm/clevr_count_grpo.py --config examples/vlm/clevr_count_grpo_cpu.yaml \
        --shuffle-rewards
    python examples/vlm/clevr_count_grpo.py --config examples/vlm/clevr_count_grpo_cpu.yaml \
        --random-rewards

The workflow is :class:`areal.workflow.vision_rlvr.VisionRLVRWorkflow` with
``clevr_count_70k_reward_fn`` (the last ``[N]`` of the completion against the count), or
``geometry3k_reward_fn`` when the training set's path names geometry3k.
``--shuffle-rewards`` is the standard control: every training batch's reward VALUES are
permuted across its samples before the advantages are computed (the trainer's
``compute_advantages`` is wrapped), so a completion's reward no longer depends on the
completion while the batch keeps its reward rate; evaluation and the logged
``batch/accuracy`` still use the true rewards. ``--random-rewards``: reward 1 with
probability 0.3 (the base's sampled accuracy) whatever the completion. Both controls
use the same config and seed as the true run. Overrides: ``key.sub=value``.
"""

import os
import random
import sys

import torch

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer
from areal.utils.stats_logger import StatsLogger

REWARD_FN = "areal.reward.clevr_count_70k.clevr_count_70k_reward_fn"
GEOMETRY3K_REWARD_FN = "areal.reward.geometry3k.geometry3k_reward_fn"
WORKFLOW = "areal.workflow.vision_rlvr.VisionRLVRWorkflow"


# Rate of the random-reward control: the base model's sampled accuracy (tiny-vlm README).
RANDOM_REWARD_RATE = 0.3


def random_reward_fn(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    """Control: 1.0 with probability RANDOM_REWARD_RATE, whatever the completion."""
    return 1.0 if random.random() < RANDOM_REWARD_RATE else 0.0


def permute_rewards(batch, generator: torch.Generator):
    """``batch`` with its ``rewards`` permuted across the samples (the shuffled-reward control).

    A plain dict is copied; a ``BatchRef`` (the batch held on the actor's workers) has only
    its ``rewards`` fetched and replaced, so the images never travel back and forth.
    """
    rewards = batch["rewards"]
    perm = torch.randperm(rewards.shape[0], generator=generator)
    if isinstance(batch, dict):
        return {**batch, "rewards": rewards[perm]}
    batch["rewards"] = rewards[perm]
    return batch


class ShuffledRewardAdvantages:
    """Wraps ``trainer.actor.compute_advantages``: each batch's rewards are permuted first.

    The rewards reach the advantage computation with their batch's values but no link to
    the completions they were computed for: whatever moves then is drift, not learning.
    """

    def __init__(self, compute_advantages, seed: int):
        self.compute_advantages = compute_advantages
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, batch, *args, **kwargs):
        return self.compute_advantages(permute_rewards(batch, self.generator), *args, **kwargs)


def main(argv):
    shuffle = "--shuffle-rewards" in argv
    randomize = "--random-rewards" in argv
    argv = [a for a in argv if a not in ("--shuffle-rewards", "--random-rewards")]
    config, _ = load_expr_config(argv, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)

    from areal.utils.vlm import load_vlm_processor

    processor = load_vlm_processor(config.tokenizer_path, tokenizer=tokenizer)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer, processor)
    valid_dataset = (
        get_custom_dataset("test", config.valid_dataset, tokenizer, processor)
        if config.valid_dataset is not None
        else None
    )

    log_path = StatsLogger.get_log_path(config.stats_logger)
    reward_fn = REWARD_FN
    if "geometry3k" in str(config.train_dataset.path).lower():
        reward_fn = GEOMETRY3K_REWARD_FN
    train_reward_fn = random_reward_fn if randomize else reward_fn
    workflow_kwargs = dict(
        reward_fn=train_reward_fn,
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
        processor=config.tokenizer_path,
        enable_thinking=False,
        dump_dir=os.path.join(log_path, "generated"),
    )
    eval_workflow_kwargs = workflow_kwargs.copy()
    eval_workflow_kwargs["reward_fn"] = reward_fn  # evaluation always scores true answers
    eval_workflow_kwargs["gconfig"] = config.eval_gconfig
    eval_workflow_kwargs["rollout_stat_scope"] = "eval-rollout"
    eval_workflow_kwargs["dump_dir"] = os.path.join(log_path, "generated-eval")

    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        if shuffle:
            trainer.actor.compute_advantages = ShuffledRewardAdvantages(
                trainer.actor.compute_advantages, seed=config.seed
            )
        result = trainer.train(
            workflow=WORKFLOW,
            workflow_kwargs=workflow_kwargs,
            eval_workflow=WORKFLOW,
            eval_workflow_kwargs=eval_workflow_kwargs,
        )

    before = result.get("initial_eval", {}).get("eval/accuracy")
    after = result.get("final_eval", {}).get("eval/accuracy")
    print("=" * 72)
    kind = "true counts"
    if shuffle:
        kind = "SHUFFLED reward values within each batch (control)"
    if randomize:
        kind = f"RANDOM rewards at rate {RANDOM_REWARD_RATE} (control)"
    print(f"training rewards: {kind}")
    if before is not None:
        print(f"held-out accuracy before RL: {before:.3f}")
    if after is not None:
        print(f"held-out accuracy after  RL: {after:.3f}  ({result['total_steps']} steps)")
    print(f"curves: {os.path.join(result['log_dir'], 'curves.png')}")
    print(f"stats:  {os.path.join(result['log_dir'], 'stats.jsonl')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
