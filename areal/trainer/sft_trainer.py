"""SFTTrainer: supervised fine-tuning on the same engine and controller as RL.

Rows are chat-format (``messages``) with a target ``answer`` (or already tokenized rows
with ``input_ids`` + ``loss_mask``); :func:`tokenize_sft_rows` makes the batch. The loss
is the mean negative log-likelihood of the target tokens; the prompt is masked out.
The lifecycle is :class:`~areal.trainer.supervised.SupervisedTrainer`'s; the engine
code is :mod:`areal.trainer.sft.lm_engine`. Each step: tokenize the rows,
``train_lm`` on the workers, step the LR scheduler; the evaluator's loss is the
token-weighted NLL of the validation set.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.api.cli_args import SFTConfig
from areal.infra.controller.train_controller import TrainController
from areal.trainer.common import run_step_loop
from areal.trainer.sft.lm_engine import LM_ENGINE, FSDPLMEngine, sft_loss_fn, sft_loss_weight_fn
from areal.trainer.supervised import SupervisedTrainer
from areal.utils import logging

logger = logging.getLogger("SFTTrainer")

__all__ = [
    "LM_ENGINE",
    "FSDPLMEngine",
    "SFTTrainer",
    "sft_loss_fn",
    "sft_loss_weight_fn",
    "tokenize_sft_rows",
]


def tokenize_sft_rows(
    rows: list[dict[str, Any]], tokenizer: Any, max_length: int | None = None
) -> dict[str, Any]:
    """Chat-template the prompt, append ``answer`` + EOS; pad right. Prompt tokens get loss_mask 0.

    Rows with ``multi_modal_input`` (image SFT rows) keep it, one entry per row."""
    seqs: list[list[int]] = []
    masks: list[list[int]] = []
    for row in rows:
        if "input_ids" in row and "loss_mask" in row:
            ids, lm = list(row["input_ids"]), list(row["loss_mask"])
        else:
            if "messages" in row:
                prompt = tokenizer.apply_chat_template(
                    row["messages"], add_generation_prompt=True, tokenize=False
                )
            else:
                prompt = row["question"]
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a_ids = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id
            ]
            ids, lm = p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)
        if max_length is not None:
            ids, lm = ids[:max_length], lm[:max_length]
        seqs.append(ids)
        masks.append(lm)
    T = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.bool)
    loss_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = True
        loss_mask[i, : len(m)] = torch.tensor(m)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    # VLM rows (areal.dataset.vision, type="sft"): one {pixel_values, image_grid_thw} per
    # row, {} for text-only rows; FSDPEngine feeds them to the vision tower
    mm = [row.get("multi_modal_input") for row in rows]
    if any(mm):
        out["multi_modal_input"] = [(m[0] if isinstance(m, list) else m) or {} for m in mm]
    return out


class SFTTrainer(SupervisedTrainer):
    """``with SFTTrainer(config, train_dataset, valid_dataset) as t: t.train()``."""

    role = "model"
    engine_class = LM_ENGINE
    config: SFTConfig

    def _engine_config(self) -> Any:
        return self.config.model

    @property
    def model(self) -> TrainController:
        """The trained model's controller."""
        return self.controller

    def _batch(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return tokenize_sft_rows(rows, self.tokenizer, self.config.train_dataset.max_length)

    def evaluate(self) -> float:
        if self.valid_dataloader is None:
            return float("nan")
        losses, weights = [], []
        for rows in self.valid_dataloader:
            b = self._batch(rows)
            losses.append(self.model.evaluate_lm(b))
            weights.append(float(b["loss_mask"].sum()))
        return sum(lo * w for lo, w in zip(losses, weights, strict=True)) / max(sum(weights), 1.0)

    def train(self) -> dict[str, Any]:
        def train_step(rows: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
            stats = dict(self.model.train_lm(self._batch(rows)))
            self.model.step_lr_scheduler()
            return float(stats.get("loss", float("nan"))), stats

        losses = run_step_loop(
            self,
            self.model,
            train_step,
            self.evaluate,
            lambda _step, ev: {"eval/loss": ev},
            logger,
            prefix="sft/",
        )
        return {"losses": losses, "log_dir": self.log_dir}
