"""Reward-model (Bradley-Terry) training on a value-head model.

Batches hold preference pairs as adjacent rows ``[chosen_0, rejected_0, chosen_1, ...]``
(:func:`areal.trainer.preference.collate_pairs`). The reward of a sequence is the value
head's output at its last token; the loss of a pair is
``-log sigmoid(r_chosen - r_rejected)``. Pairs stay together on one data-parallel rank
(``group_size=2``) and in one micro-batch (``mb_spec.granularity=2``), so micro-batches
are packed whole pairs.

- :func:`compute_rw_loss`: the loss function of ``TrainEngine.train_batch``.
- :class:`RWEngine`: the algorithm over any critic ``TrainEngine`` (``train_rw``,
  ``evaluate_rw``); :class:`RWEngineHost` mixes it into an engine and
  ``FSDPRWEngine(RWEngineHost, FSDPEngine)`` is the workers' class (the hosting
  pattern of :mod:`areal.trainer.ppo`); :class:`RWController` dispatches with whole
  pairs per rank. The pair plumbing is :mod:`areal.trainer.pairs`, shared with DPO.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.engine.fsdp import FSDPEngine
from areal.trainer.pairs import (
    PairController,
    pair_loss_weight,
    train_pair_step,
    with_pair_granularity,
)
from areal.utils import logging, stats_tracker

logger = logging.getLogger("RWEngine")

RW_ENGINE = "areal.trainer.rw.rw_engine.FSDPRWEngine"


def pair_scores(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Last-token value of each packed sequence, as ``[n_pairs, 2]`` (chosen, rejected)."""
    cu = cu_seqlens.to(device=values.device, dtype=torch.long)
    n = cu.numel() - 1
    if n % 2:
        raise ValueError(f"reward-model micro-batch has {n} sequences; pairs need an even number")
    if bool(((cu[1:] - cu[:-1]) <= 0).any()):
        raise ValueError("reward-model micro-batch has an empty sequence")
    return values[cu[1:] - 1].float().view(-1, 2)


def compute_rw_loss(
    values: torch.Tensor, entropy: torch.Tensor | None, input_data: dict[str, Any]
) -> torch.Tensor:
    """Mean Bradley-Terry loss ``-logsigmoid(r_chosen - r_rejected)`` over the pairs of one
    packed micro-batch; records ``loss``, ``accuracy`` (r_chosen > r_rejected), ``margin``
    (r_chosen - r_rejected), ``chosen_reward``, ``rejected_reward`` per pair."""
    scores = pair_scores(values, input_data["cu_seqlens"])
    margin = scores[:, 0] - scores[:, 1]
    loss = -torch.nn.functional.logsigmoid(margin)
    with torch.no_grad():
        stats_tracker.denominator(n_pairs=torch.ones_like(margin, dtype=torch.bool))
        stats_tracker.stat(
            loss=loss.detach(),
            accuracy=(margin > 0).float(),
            margin=margin.detach(),
            chosen_reward=scores[:, 0].detach(),
            rejected_reward=scores[:, 1].detach(),
            denominator="n_pairs",
        )
    return loss.mean()


rw_loss_weight = pair_loss_weight  # pairs in the micro-batch (the loss is a mean over pairs)


def pair_metrics(scores: torch.Tensor) -> dict[str, float]:
    """Loss / accuracy / margin of ``[n_pairs, 2]`` scores (evaluation)."""
    margin = scores[:, 0] - scores[:, 1]
    return {
        "loss": float(-torch.nn.functional.logsigmoid(margin).mean()),
        "accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
        "n_pairs": float(margin.numel()),
    }


class RWEngine:
    """Reward-model training over a critic :class:`~areal.api.engine_api.TrainEngine`."""

    def __init__(self, engine: Any):
        self.engine = engine

    def train_rw(self, data: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on a batch of pairs; stats go to ``stats_tracker`` under ``rw/``."""
        return train_pair_step(self.engine, data, compute_rw_loss, "rw")

    @torch.no_grad()
    def evaluate_rw(self, data: dict[str, Any]) -> torch.Tensor:
        """Per-pair scores ``[n_pairs, 2]`` of this rank's share (chosen, rejected)."""
        values = self.engine.forward_batch(data)  # [B, T] value at each token
        lens = data["attention_mask"].sum(-1).long()
        last = values[torch.arange(values.shape[0]), (lens - 1).clamp(min=0)]
        return last.float().view(-1, 2)


class RWEngineHost:
    """Engine mixin: hosts an :class:`RWEngine` (``train_rw`` / ``evaluate_rw``) on a
    value-head engine whose micro-batches hold whole pairs."""

    rw: RWEngine

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        config = with_pair_granularity(config)
        config.is_critic = True  # the reward is the value head's output
        super().__init__(config, *args, **kwargs)
        self.rw = RWEngine(self)

    def train_rw(self, data: dict[str, Any]) -> dict[str, float]:
        return self.rw.train_rw(data)

    def evaluate_rw(self, data: dict[str, Any]) -> torch.Tensor:
        return self.rw.evaluate_rw(data)


class FSDPRWEngine(RWEngineHost, FSDPEngine):
    """FSDP critic engine hosting an :class:`RWEngine`."""


class RWController(PairController):
    """``TrainController`` for reward-model workers: whole pairs per rank."""

    def train_rw(self, data: dict[str, Any]) -> dict[str, float]:
        return self.pair_call("train_rw", data)

    def evaluate_rw(self, data: dict[str, Any]) -> dict[str, float]:
        """Loss / accuracy / margin over all pairs of ``data`` (all ranks)."""
        per_rank = self.pair_call_per_rank("evaluate_rw", data)
        return pair_metrics(torch.cat([s.reshape(-1, 2) for s in per_rank], 0))
