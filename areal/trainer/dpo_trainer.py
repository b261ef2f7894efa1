"""DPOTrainer: Direct Preference Optimization (sigmoid or IPO loss) against a frozen reference.

``with DPOTrainer(config, train_dataset, valid_dataset) as t: t.train()`` with a
``DPOConfig`` (``actor``: the trained policy with ``beta`` / ``loss_type``; ``ref``: the
frozen reference, usually the same checkpoint) and preference rows (``type: dpo``). The
reference model is built in the same worker processes as the policy; its logprobs are
computed once per batch. Engine code: :mod:`areal.trainer.dpo.dpo_engine`.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.api.cli_args import DPOConfig
from areal.trainer.dpo.dpo_engine import DPO_ENGINE, DPOController
from areal.trainer.preference import PreferenceTrainer


class DPOTrainer(PreferenceTrainer):
    """DPO trainer on the same controller/worker stack as PPO and SFT."""

    _scope = "dpo"
    engine_class = DPO_ENGINE
    controller_class = DPOController
    config: DPOConfig

    def _init_kwargs(self) -> dict[str, Any]:
        ref = self.config.ref
        if not ref.path:
            ref.path = self.config.actor.path
        return {"ref_config": ref}

    def _train_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.actor.train_dpo(batch)

    def _eval_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.actor.evaluate_dpo(batch)
