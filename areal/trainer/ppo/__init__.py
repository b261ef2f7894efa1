"""PPO-family algorithm code: ``PPOActor`` / ``PPOCritic`` and their FSDP hosts.

``FSDPPPOActor`` and ``FSDPPPOCritic`` are resolved lazily (they subclass the FSDP engine);
AReaL's ``PPOActorController`` / ``PPOCriticController`` are the generic ``TrainController``.
"""

from __future__ import annotations

from typing import Any

from areal.trainer.ppo.actor import PPOActor, grpo_loss_fn
from areal.trainer.ppo.critic import PPOCritic

__all__ = ["PPOActor", "PPOCritic", "grpo_loss_fn"]  # + FSDPPPOActor, FSDPPPOCritic (lazy)


def __getattr__(name: str) -> Any:
    if name in ("PPOActorController", "PPOCriticController"):
        # AReaL's per-role controllers: here one generic TrainController drives any engine
        # (its compute_logp / compute_advantages / ppo_update calls go to the workers).
        from areal.infra.controller.train_controller import TrainController

        return TrainController
    if name == "FSDPPPOActor":
        from areal.trainer.ppo import actor

        return actor.FSDPPPOActor
    if name == "FSDPPPOCritic":
        from areal.trainer.ppo import critic

        return critic.FSDPPPOCritic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
