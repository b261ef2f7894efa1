"""A PPOTrainer controller for ``tests/test_run_health.py`` (run as a subprocess).

    python tests/_run_health_trainer.py first|resumed --config ... key=value ...

``first``: at version 0 one episode (task) in 5 raises (occasional failures, counted);
from version 1 on the episodes never finish, so the trainer waits for the batch of step 1
until a signal ends it. ``resumed``: plain episodes at version 1; from version 2 on every
episode raises (a dependency that went away), which must stop the run.
"""

from __future__ import annotations

import asyncio
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.infra import workflow_context
from areal.utils.hf_utils import load_hf_tokenizer
from areal.workflow.rlvr import RLVRWorkflow


class ScriptedHealthRLVR(RLVRWorkflow):
    """``RLVRWorkflow`` that fails or hangs by policy version (module docstring)."""

    def __init__(self, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    async def arun_episode(self, engine, data):
        version = engine.get_version()
        if self.mode == "first":
            if version >= 1:
                await asyncio.sleep(3600)
            tid = workflow_context.get().task_id
            if tid is not None and tid % 5 == 2:
                raise RuntimeError(f"simulated tool crash in task {tid}")
        elif version >= 2:
            raise RuntimeError("simulated sandbox unreachable at 10.0.0.7:8080")
        return await super().arun_episode(engine, data)


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    config, _ = load_expr_config(args, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset("train", config.train_dataset, tokenizer)
    workflow = ScriptedHealthRLVR(
        mode,
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
    )
    with PPOTrainer(config, train_dataset=train) as trainer:
        trainer.train(workflow=workflow)


if __name__ == "__main__":
    main(sys.argv[1:])
