"""SFTTrainer: supervised fine-tuning on the same engine and controller as RL.

Rows are chat-format (``messages``) with a target ``answer`` (or already tokenized rows
with ``input_ids`` + ``loss_mask``). The loss is the mean negative log-likelihood of the
target tokens; the prompt is masked out.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.api.alloc_mode import AllocationMode
from areal.api.cli_args import SFTConfig
from areal.api.io_struct import SaveLoadMeta
from areal.engine.fsdp_engine import FSDPEngine
from areal.trainer.common import make_scheduler, run_step_loop, setup_run, teardown_run
from areal.utils import logging
from areal.utils.evaluator import Evaluator
from areal.utils.recover import RecoverHandler
from areal.utils.saver import Saver
from areal.utils.stats_logger import StatsLogger

logger = logging.getLogger("SFTTrainer")

LM_ENGINE = "areal.trainer.sft_trainer.FSDPLMEngine"


def sft_loss_fn(
    logprobs: torch.Tensor, entropy: torch.Tensor, input_data: dict[str, Any]
) -> torch.Tensor:
    """Mean NLL over target tokens of one packed micro-batch."""
    mask = input_data["loss_mask"].bool()
    n = mask.count_nonzero().clamp(min=1)
    return -(logprobs * mask).sum() / n


def sft_loss_weight_fn(input_data: dict[str, Any]) -> torch.Tensor:
    return input_data["loss_mask"].count_nonzero()


class FSDPLMEngine(FSDPEngine):
    """FSDP engine with the SFT step (``train_lm`` / ``evaluate_lm``)."""

    def train_lm(self, data: dict[str, Any]) -> dict[str, float]:
        self.train()
        return self.train_batch(data, loss_fn=sft_loss_fn, loss_weight_fn=sft_loss_weight_fn)

    def evaluate_lm(self, data: dict[str, Any]) -> float:
        self.eval()
        loss = self.eval_batch(data, loss_fn=sft_loss_fn, loss_weight_fn=sft_loss_weight_fn)
        return float(loss) if loss is not None else float("nan")


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


class SFTTrainer:
    """``with SFTTrainer(config, train_dataset, valid_dataset) as t: t.train()``."""

    def __init__(self, config: SFTConfig, train_dataset: Any, valid_dataset: Any = None):
        from areal.infra.controller.train_controller import TrainController
        from areal.utils.dataloader import create_dataloader

        self.config = config
        self._closed = False
        run = setup_run(config, train_dataset, model_path=config.model.path)
        self.log_dir, self.tokenizer = run.log_dir, run.tokenizer
        self.train_dataloader, self.ft_spec = run.train_dataloader, run.ft_spec
        alloc = config.allocation_mode or (config.model.backend or "fsdp:d1")
        self.alloc_mode = AllocationMode.from_str(alloc)
        self.train_dataset = train_dataset
        self.valid_dataset = valid_dataset
        self.valid_dataloader = (
            create_dataloader(valid_dataset, config.valid_dataset, seed=config.seed)
            if valid_dataset is not None and config.valid_dataset is not None
            else None
        )
        try:
            self.scheduler = make_scheduler(config)
            self.model = TrainController(LM_ENGINE, config.model, self.scheduler)
            self.model.initialize(
                role="model", alloc_mode=self.alloc_mode, ft_spec=self.ft_spec, seed=config.seed
            )
        except BaseException:
            self.close()
            raise
        self.saver = Saver(config.saver, self.ft_spec)
        self.evaluator = Evaluator(config.evaluator, self.ft_spec)
        self.stats_logger = StatsLogger(config.stats_logger, self.ft_spec)
        self.recover_handler = RecoverHandler(config.recover, self.ft_spec)

    def __enter__(self) -> SFTTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        teardown_run(self, ("model",))

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

    def save_hf(self, path: str) -> None:
        self.model.save(SaveLoadMeta(path=path, weight_format="hf", tokenizer=self.tokenizer))
