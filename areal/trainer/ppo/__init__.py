"""PPO-family algorithm code: ``PPOActor`` / ``PPOCritic`` and the engines that host them.

How an algorithm is hosted on a training engine (the same for every folder of
``areal/trainer``: ``ppo/``, ``rw/``, ``dpo/``, ``sft/``):

1. the algorithm is an engine-agnostic class built over any
   :class:`~areal.api.engine_api.TrainEngine` (``PPOActor(config, engine)``): it calls
   only the engine contract (``forward_batch``, ``train_batch``, ``train``/``eval``, ...);
2. a mixin (``PPOActorHost``) builds it after the engine's own ``__init__`` and exposes
   its worker calls (``compute_logp``, ``compute_advantages``, ``ppo_update``) as engine
   methods, which the controller reaches by name over RPC;
3. each training engine gets one plain subclass, mixin first:
   ``class FSDPPPOActor(PPOActorHost, FSDPEngine)``. A second engine hosts the same
   algorithm with one more line beside it, ``class XPPOActor(PPOActorHost, XEngine)``,
   and no algorithm code copied.

AReaL's ``PPOActorController`` / ``PPOCriticController`` are the generic
``TrainController`` (its ``compute_logp`` / ``compute_advantages`` / ``ppo_update`` calls
go to the workers).
"""

from __future__ import annotations

from areal.infra.controller.train_controller import TrainController
from areal.trainer.ppo.actor import FSDPPPOActor, PPOActor, PPOActorHost, grpo_loss_fn
from areal.trainer.ppo.critic import FSDPPPOCritic, PPOCritic, PPOCriticHost

PPOActorController = TrainController
PPOCriticController = TrainController

__all__ = [
    "FSDPPPOActor",
    "FSDPPPOCritic",
    "PPOActor",
    "PPOActorController",
    "PPOActorHost",
    "PPOCritic",
    "PPOCriticController",
    "PPOCriticHost",
    "grpo_loss_fn",
]
