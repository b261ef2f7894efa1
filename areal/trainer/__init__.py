"""Trainers: ``PPOTrainer`` (RL), ``SFTTrainer``, ``RWTrainer`` and ``DPOTrainer``; algorithm
code in ``ppo/``, ``rw/``, ``dpo/`` and ``sft/``, each hosted on a training engine the same
way (see :mod:`areal.trainer.ppo`). The trainers are resolved on first use so that
importing one module of the package (``areal.trainer.common``) stays light."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "PPOTrainer":
        from areal.trainer.rl_trainer import PPOTrainer

        return PPOTrainer
    if name == "SFTTrainer":
        from areal.trainer.sft_trainer import SFTTrainer

        return SFTTrainer
    if name == "RWTrainer":
        from areal.trainer.rw_trainer import RWTrainer

        return RWTrainer
    if name == "DPOTrainer":
        from areal.trainer.dpo_trainer import DPOTrainer

        return DPOTrainer
    raise AttributeError(name)
