"""Supervised fine-tuning: the NLL loss and its engine (see ``lm_engine``; hosted as
:mod:`areal.trainer.ppo` describes: ``LMEngine``, ``LMEngineHost``, ``FSDPLMEngine``).
The trainer is :class:`areal.trainer.sft_trainer.SFTTrainer`."""

from areal.trainer.sft.lm_engine import FSDPLMEngine, LMEngine, LMEngineHost

__all__ = ["FSDPLMEngine", "LMEngine", "LMEngineHost"]
