"""Trainers: ``PPOTrainer`` (RL) and ``SFTTrainer``; PPO actor/critic code in ``ppo/``."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "PPOTrainer":
        from areal.trainer.rl_trainer import PPOTrainer

        return PPOTrainer
    if name == "SFTTrainer":
        from areal.trainer.sft_trainer import SFTTrainer

        return SFTTrainer
    raise AttributeError(name)
