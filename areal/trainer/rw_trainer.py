"""RWTrainer: reward-model training (Bradley-Terry loss on a value head).

``with RWTrainer(config, train_dataset, valid_dataset) as t: t.train()`` with an
``RWConfig`` (``actor.is_critic: true``) and preference rows (``type: rw``). Each step
trains on ``train_dataset.batch_size`` pairs; the evaluator reports held-out ``loss``,
``accuracy`` (reward of chosen > rejected) and ``margin``. Engine code:
:mod:`areal.trainer.rw.rw_engine`.
"""

from __future__ import annotations

import torch

from areal.api.cli_args import RWConfig
from areal.trainer.preference import PreferenceTrainer
from areal.trainer.rw.rw_engine import RW_ENGINE, RWController


class RWTrainer(PreferenceTrainer):
    """Reward-model trainer on the same controller/worker stack as PPO and SFT."""

    _scope = "rw"
    engine_class = RW_ENGINE
    controller_class = RWController
    config: RWConfig

    def _train_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.actor.train_rw(batch)

    def _eval_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.actor.evaluate_rw(batch)
