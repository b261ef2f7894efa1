"""Reward-model (Bradley-Terry) training on a value-head model.

Batches hold preference pairs as adjacent rows ``[chosen_0, rejected_0, chosen_1, ...]``
(:func:`areal.trainer.preference.collate_pairs`). The reward of a sequence is the value
head's output at its last token; the loss of a pair is
``-log sigmoid(r_chosen - r_rejected)``. Pairs stay together on one data-parallel rank
(``group_size=2``) and in one micro-batch (``mb_spec.granularity=2``), so micro-batches
are packed whole pairs.

- :func:`compute_rw_loss`: the loss function of ``TrainEngine.train_batch``.
- :class:`RWEngine`: the algorithm over a critic ``TrainEngine`` (``train_rw``,
  ``evaluate_rw``); :class:`FSDPRWEngine` is the FSDP engine hosting it (the workers'
  class); :class:`RWController` dispatches with whole pairs per rank.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from areal.infra.controller.train_controller import TrainController
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


def rw_loss_weight(input_data: dict[str, Any]) -> torch.Tensor:
    """Number of pairs in the micro-batch (the loss is a mean over pairs)."""
    return torch.tensor((input_data["cu_seqlens"].numel() - 1) // 2)


def pair_metrics(scores: torch.Tensor) -> dict[str, float]:
    """Loss / accuracy / margin of ``[n_pairs, 2]`` scores (evaluation)."""
    margin = scores[:, 0] - scores[:, 1]
    return {
        "loss": float(-torch.nn.functional.logsigmoid(margin).mean()),
        "accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
        "n_pairs": float(margin.numel()),
    }


def with_pair_granularity(config: Any) -> Any:
    """A copy of an engine config whose ``mb_spec`` keeps pairs in one micro-batch."""
    config = copy.copy(config)
    spec = getattr(config, "mb_spec", None)
    if spec is not None:
        g = int(getattr(spec, "granularity", 1) or 1)
        config.mb_spec = dataclasses.replace(spec, granularity=2 * g if g % 2 else g)
    return config


class RWEngine:
    """Reward-model training over a critic :class:`~areal.api.engine_api.TrainEngine`."""

    def __init__(self, engine: Any):
        self.engine = engine

    def train_rw(self, data: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on a batch of pairs; stats go to ``stats_tracker`` under ``rw/``."""
        self.engine.train()
        with stats_tracker.scope("rw"):
            stats = self.engine.train_batch(
                data, loss_fn=compute_rw_loss, loss_weight_fn=rw_loss_weight
            )
            # per-pair loss is recorded by the loss function; the rest are step scalars
            stats_tracker.scalar(**{k: float(v) for k, v in stats.items() if k != "loss"})
        return stats

    @torch.no_grad()
    def evaluate_rw(self, data: dict[str, Any]) -> torch.Tensor:
        """Per-pair scores ``[n_pairs, 2]`` of this rank's share (chosen, rejected)."""
        values = self.engine.forward_batch(data)  # [B, T] value at each token
        lens = data["attention_mask"].sum(-1).long()
        last = values[torch.arange(values.shape[0]), (lens - 1).clamp(min=0)]
        return last.float().view(-1, 2)


def _make_fsdp_rw_engine() -> type:
    from areal.engine.fsdp_engine import FSDPEngine

    class FSDPRWEngine(FSDPEngine):
        """FSDP critic engine (``is_critic=True``) hosting an :class:`RWEngine`."""

        def __init__(self, config: Any):
            config = with_pair_granularity(config)
            if not getattr(config, "is_critic", False):
                config.is_critic = True
            super().__init__(config)
            self.rw = RWEngine(self)

        def train_rw(self, data: dict[str, Any]) -> dict[str, float]:
            return self.rw.train_rw(data)

        def evaluate_rw(self, data: dict[str, Any]) -> torch.Tensor:
            return self.rw.evaluate_rw(data)

    FSDPRWEngine.__module__ = __name__
    FSDPRWEngine.__qualname__ = "FSDPRWEngine"
    return FSDPRWEngine


class RWController(TrainController):
    """``TrainController`` whose batch calls keep each (chosen, rejected) pair on one rank."""

    def __init__(self, train_engine: Any, config: Any, scheduler: Any, **kwargs: Any):
        kwargs.setdefault("group_size", 2)
        super().__init__(train_engine, config, scheduler, **kwargs)

    def train_rw(self, data: dict[str, Any]) -> dict[str, float]:
        return self.custom_function_call("train_rw", data, _group_size=2)

    def evaluate_rw(self, data: dict[str, Any]) -> dict[str, float]:
        """Loss / accuracy / margin over all pairs of ``data`` (all ranks)."""
        per_rank = self.custom_function_call("evaluate_rw", data, _group_size=2, _merge=False)
        return pair_metrics(torch.cat([s.reshape(-1, 2) for s in per_rank], 0))


def __getattr__(name: str) -> Any:
    if name == "FSDPRWEngine":
        cls = _make_fsdp_rw_engine()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
