"""A PPOTrainer controller for ``tests/test_run_health.py`` (run as a subprocess).

    python tests/_run_health_trainer.py hang|plain --config ... key=value ...

``hang``: the rollouts of every step after the first never finish (the workflow sleeps
once the policy version is 1 or more), so the trainer waits for the batch of step 1 until
a signal ends it. ``plain``: the plain ``RLVRWorkflow`` (the resumed run).
"""

from __future__ import annotations

import asyncio
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer
from areal.workflow.rlvr import RLVRWorkflow


class HangFromVersionOne(RLVRWorkflow):
    """``RLVRWorkflow`` whose episodes started at version >= 1 never finish."""

    async def arun_episode(self, engine, data):
        if engine.get_version() >= 1:
            await asyncio.sleep(3600)
        return await super().arun_episode(engine, data)


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    config, _ = load_expr_config(args, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset("train", config.train_dataset, tokenizer)
    cls = HangFromVersionOne if mode == "hang" else RLVRWorkflow
    workflow = cls(
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
    )
    with PPOTrainer(config, train_dataset=train) as trainer:
        trainer.train(workflow=workflow)


if __name__ == "__main__":
    main(sys.argv[1:])
