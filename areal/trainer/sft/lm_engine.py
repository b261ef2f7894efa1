"""Supervised fine-tuning of a language model: the NLL loss, its engine and host.

The loss is the mean negative log-likelihood of the target tokens (``loss_mask`` 1;
the prompt is masked out) of a packed micro-batch. :class:`LMEngine` is the algorithm
over any :class:`~areal.api.engine_api.TrainEngine` (``train_lm`` / ``evaluate_lm``);
:class:`LMEngineHost` mixes it into an engine and ``FSDPLMEngine(LMEngineHost,
FSDPEngine)`` is the workers' class (the hosting pattern of :mod:`areal.trainer.ppo`).
"""

from __future__ import annotations

from typing import Any

import torch

from areal.api.engine_api import TrainEngine
from areal.engine.fsdp import FSDPEngine

__all__ = [
    "LM_ENGINE",
    "FSDPLMEngine",
    "LMEngine",
    "LMEngineHost",
    "sft_loss_fn",
    "sft_loss_weight_fn",
]

LM_ENGINE = "areal.trainer.sft.lm_engine.FSDPLMEngine"


def sft_loss_fn(
    logprobs: torch.Tensor, entropy: torch.Tensor | None, input_data: dict[str, Any]
) -> torch.Tensor:
    """Mean NLL over target tokens of one packed micro-batch."""
    mask = input_data["loss_mask"].bool()
    n = mask.count_nonzero().clamp(min=1)
    return -(logprobs * mask).sum() / n


def sft_loss_weight_fn(input_data: dict[str, Any]) -> torch.Tensor:
    """Target tokens in the micro-batch (the loss is a mean over them)."""
    return input_data["loss_mask"].count_nonzero()


class LMEngine:
    """The SFT step over a :class:`TrainEngine`."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def train_lm(self, data: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on ``data``; the engine's step stats."""
        self.engine.train()
        return self.engine.train_batch(data, loss_fn=sft_loss_fn, loss_weight_fn=sft_loss_weight_fn)

    def evaluate_lm(self, data: dict[str, Any]) -> float:
        """Mean NLL of ``data``'s target tokens (``nan`` when there are none)."""
        self.engine.eval()
        loss = self.engine.eval_batch(data, loss_fn=sft_loss_fn, loss_weight_fn=sft_loss_weight_fn)
        return float(loss) if loss is not None else float("nan")


class LMEngineHost:
    """Engine mixin: hosts an :class:`LMEngine` (``train_lm`` / ``evaluate_lm``)."""

    lm: LMEngine

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.lm = LMEngine(self)

    def train_lm(self, data: dict[str, Any]) -> dict[str, float]:
        return self.lm.train_lm(data)

    def evaluate_lm(self, data: dict[str, Any]) -> float:
        return self.lm.evaluate_lm(data)


class FSDPLMEngine(LMEngineHost, FSDPEngine):
    """FSDP engine hosting an :class:`LMEngine` (the SFT workers' class)."""
