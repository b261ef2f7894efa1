"""Supervised fine-tuning: the NLL loss and its engine (see ``lm_engine``).

Hosted like every algorithm of ``areal/trainer`` (see :mod:`areal.trainer.ppo`): the
engine-agnostic ``LMEngine``, the ``LMEngineHost`` mixin, ``FSDPLMEngine`` for FSDP.
The trainer is :class:`areal.trainer.sft_trainer.SFTTrainer`.
"""

from areal.trainer.sft.lm_engine import (
    LM_ENGINE,
    FSDPLMEngine,
    LMEngine,
    LMEngineHost,
    sft_loss_fn,
    sft_loss_weight_fn,
)

__all__ = [
    "LM_ENGINE",
    "FSDPLMEngine",
    "LMEngine",
    "LMEngineHost",
    "sft_loss_fn",
    "sft_loss_weight_fn",
]
