"""Saver: periodic Hugging Face checkpoints of a train engine (for export, not for resume)."""

from __future__ import annotations

import os
from typing import Any

from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
from areal.utils import logging
from areal.utils.timeutil import EpochStepTimeFreqCtl

logger = logging.getLogger("Saver")


def get_save_root(config: Any, name: str = "default") -> str:
    return os.path.join(
        str(config.fileroot),
        "checkpoints",
        str(config.experiment_name),
        str(config.trial_name),
        name,
    )


class Saver:
    """Saves HF weights every ``freq_epochs`` / ``freq_steps`` / ``freq_secs``."""

    def __init__(self, config: Any, ft_spec: FinetuneSpec):
        self.config = config
        self.ft_spec = ft_spec
        self.freq_ctl = EpochStepTimeFreqCtl(
            freq_epoch=config.freq_epochs, freq_step=config.freq_steps, freq_sec=config.freq_secs
        )
        if config.mode == "async":
            logger.warning(
                "saver.mode='async': Hugging Face exports are written synchronously by this "
                "engine (as AReaL does for non-Archon engines); the background write is that "
                "of recover checkpoints, recover.save_mode=async"
            )

    @staticmethod
    def get_save_checkpoint_path(
        config: Any, epoch: int, step: int, global_step: int, name: str = "default"
    ) -> str:
        return os.path.join(
            get_save_root(config, name), f"epoch{epoch}epochstep{step}globalstep{global_step}"
        )

    def save(
        self,
        engine: Any,
        epoch: int,
        step: int,
        global_step: int,
        name: str = "default",
        tokenizer: Any = None,
        base_model_path: str | None = None,
        force: bool = False,
    ) -> str | None:
        """Save if the frequency says so (or ``force``); returns the directory written."""
        epoch_done = int(step + 1 == self.ft_spec.steps_per_epoch)
        if not (self.freq_ctl.check(epochs=epoch_done, steps=1) or force):
            return None
        path = self.get_save_checkpoint_path(self.config, epoch, step, global_step, name)
        engine.save(
            SaveLoadMeta(
                path=path, weight_format="hf", tokenizer=tokenizer, base_model_path=base_model_path
            )
        )
        logger.info(f"Saved HF checkpoint to {path}")
        return path

    def state_dict(self) -> dict:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.freq_ctl.load_state_dict(state)
