"""What the preference-pair engines (reward model, DPO) share, on both sides of the RPC.

Batches hold preference pairs as adjacent rows ``[chosen_0, rejected_0, chosen_1, ...]``
(:func:`areal.trainer.preference.collate_pairs`). Pairs must stay whole:

- on one data-parallel rank: :class:`PairController` splits batches in units of 2;
- in one micro-batch: :func:`with_pair_granularity` makes the engine config's
  ``mb_spec.granularity`` even;
- :func:`train_pair_step` takes the one optimizer step of a batch of pairs
  (micro-batches weighted by :func:`pair_loss_weight`, their number of pairs) and
  records the step's scalars under the algorithm's ``stats_tracker`` scope.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from areal.infra.controller.train_controller import TrainController
from areal.utils import stats_tracker

__all__ = ["PairController", "pair_loss_weight", "train_pair_step", "with_pair_granularity"]


def with_pair_granularity(config: Any) -> Any:
    """A copy of an engine config whose ``mb_spec`` keeps pairs in one micro-batch."""
    config = copy.copy(config)
    spec = config.mb_spec
    if spec is not None:
        g = int(spec.granularity or 1)
        config.mb_spec = dataclasses.replace(spec, granularity=2 * g if g % 2 else g)
    return config


def pair_loss_weight(input_data: dict[str, Any]) -> torch.Tensor:
    """Pairs in a packed micro-batch (the pair losses are means over pairs)."""
    return torch.tensor((input_data["cu_seqlens"].numel() - 1) // 2)


def train_pair_step(
    engine: Any, data: dict[str, Any], loss_fn: Callable[..., torch.Tensor], scope: str
) -> dict[str, float]:
    """One optimizer step of ``engine`` on a batch of pairs; the per-pair stats are the
    loss function's, the step scalars (all but ``loss``) go to ``stats_tracker`` under
    ``scope``."""
    engine.train()
    with stats_tracker.scope(scope):
        stats = engine.train_batch(data, loss_fn=loss_fn, loss_weight_fn=pair_loss_weight)
        stats_tracker.scalar(**{k: float(v) for k, v in stats.items() if k != "loss"})
    return stats


class PairController(TrainController):
    """``TrainController`` whose batch calls keep each (chosen, rejected) pair on one rank."""

    def __init__(self, train_engine: Any, config: Any, scheduler: Any, **kwargs: Any):
        kwargs.setdefault("group_size", 2)
        super().__init__(train_engine, config, scheduler, **kwargs)

    def pair_call(self, method: str, data: dict[str, Any]) -> Any:
        """``method`` on every rank with its share of whole pairs, results merged."""
        return self.custom_function_call(method, data, _group_size=2)

    def pair_call_per_rank(self, method: str, data: dict[str, Any]) -> list[Any]:
        """``method`` on every rank with its share of whole pairs; the per-rank results."""
        return self.custom_function_call(method, data, _group_size=2, _merge=False)
