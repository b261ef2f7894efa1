"""What ``RWTrainer`` and ``DPOTrainer`` share: pair collation and the training loop.

Preference rows (:mod:`areal.dataset.hhrlhf`, ``synthetic://arith_pref``) hold
``chosen_ids`` / ``rejected_ids`` (and ``*_loss_mask`` for DPO). :func:`collate_pairs`
turns ``N`` rows into one right-padded batch of ``2N`` sequences, chosen and rejected
adjacent (``[c0, r0, c1, r1, ...]``), which the engines keep together on one
data-parallel rank and in one micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.trainer.common import run_step_loop
from areal.trainer.supervised import SupervisedTrainer
from areal.utils import logging

logger = logging.getLogger("PreferenceTrainer")


def collate_pairs(rows: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Rows of pairs -> ``input_ids`` / ``attention_mask`` / ``loss_mask`` ``[2N, T]``.

    ``loss_mask`` is the row's ``*_loss_mask`` when present, else 1 on every token.
    """
    if not rows:
        raise ValueError("collate_pairs got no rows")
    seqs: list[list[int]] = []
    masks: list[list[int]] = []
    for i, row in enumerate(rows):
        for side in ("chosen", "rejected"):
            ids = row.get(f"{side}_ids")
            if ids is None or len(ids) == 0:
                raise ValueError(f"preference row {i} has no {side}_ids")
            ids = list(ids)
            mask = row.get(f"{side}_loss_mask")
            mask = [1] * len(ids) if mask is None else list(mask)
            if len(mask) != len(ids):
                raise ValueError(
                    f"preference row {i}: {side}_loss_mask has {len(mask)} entries for "
                    f"{len(ids)} tokens"
                )
            seqs.append(ids)
            masks.append(mask)
    T = max(len(s) for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, T), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.bool)
    loss_mask = torch.zeros((B, T), dtype=torch.long)
    for b, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        input_ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention_mask[b, : len(s)] = True
        loss_mask[b, : len(m)] = torch.tensor(m, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


class PreferenceTrainer(SupervisedTrainer):
    """The loop of a pairwise trainer; subclasses say which engine and which calls.

    Lifecycle: :class:`~areal.trainer.supervised.SupervisedTrainer` (the trained model
    is ``config.actor``, role ``actor``). Subclass hooks: ``_scope`` (stats prefix),
    ``engine_class`` / ``controller_class``, ``_init_kwargs()``, ``_train_batch(batch)``
    and ``_eval_batch(batch)`` (a metrics dict with ``n_pairs``).
    """

    role = "actor"
    _scope = "pref"

    def __init__(self, config: Any, train_dataset: Any, valid_dataset: Any = None):
        super().__init__(config, train_dataset, valid_dataset)
        self.pad_token_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        )

    # ------------------------------------------------------------------ hooks
    def _engine_config(self) -> Any:
        return self.config.actor

    def _train_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        raise NotImplementedError

    def _eval_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        raise NotImplementedError

    @property
    def actor(self) -> Any:
        """The trained model's controller."""
        return self.controller

    @property
    def model(self) -> Any:
        """Alias of ``actor``."""
        return self.controller

    # ------------------------------------------------------------------ loop
    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_pairs(rows, self.pad_token_id)

    def evaluate_dataset(self, dataset: Any, batch_size: int = 64) -> dict[str, float]:
        """Metrics over every pair of ``dataset`` (weighted by pairs)."""
        rows = [dataset[i] for i in range(len(dataset))]
        return self._evaluate_rows(
            [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        )

    def evaluate(self) -> dict[str, float]:
        """Metrics over the validation set (``{}`` without one)."""
        if self.valid_dataloader is None:
            return {}
        return self._evaluate_rows(list(self.valid_dataloader))

    def _evaluate_rows(self, batches: list[list[dict[str, Any]]]) -> dict[str, float]:
        totals: dict[str, float] = {}
        n = 0.0
        for rows in batches:
            if len(rows) < self.alloc_mode.train.dp_size:
                continue  # every rank needs a pair
            m = self._eval_batch(self.collate(rows))
            k = m.pop("n_pairs")
            n += k
            for key, v in m.items():
                totals[key] = totals.get(key, 0.0) + v * k
        return {key: v / n for key, v in totals.items()} if n else {}

    def train(self) -> dict[str, Any]:
        history: list[dict[str, float]] = []

        def train_step(rows: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
            train_stats = self._train_batch(self.collate(rows))
            self.actor.step_lr_scheduler()
            # the engine's per-pair stats and step scalars, under "<scope>/"
            stats = dict(self.actor.export_stats())
            return float(train_stats.get("loss", float("nan"))), stats

        def eval_stats(global_step: int, ev: dict[str, float]) -> dict[str, float]:
            if ev:
                history.append({"step": global_step + 1, **ev})
            return {f"{self._scope}-eval/{k}": v for k, v in ev.items()}

        losses = run_step_loop(self, self.actor, train_step, self.evaluate, eval_stats, logger)
        return {"losses": losses, "eval_history": history, "log_dir": self.log_dir}
