"""Evaluator: runs an evaluation callback every N epochs / steps / seconds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal.api.io_struct import FinetuneSpec
from areal.utils.timeutil import EpochStepTimeFreqCtl


class Evaluator:
    def __init__(self, config: Any, ft_spec: FinetuneSpec):
        self.config = config
        self.ft_spec = ft_spec
        self.freq_ctl = EpochStepTimeFreqCtl(
            freq_epoch=config.freq_epochs, freq_step=config.freq_steps, freq_sec=config.freq_secs
        )

    def evaluate(
        self, evaluate_fn: Callable[[], Any], epoch: int, step: int, global_step: int
    ) -> Any:
        """Call ``evaluate_fn()`` when due; returns its result or ``None``."""
        epoch_done = int(step + 1 == self.ft_spec.steps_per_epoch)
        if not self.freq_ctl.check(epochs=epoch_done, steps=1):
            return None
        return evaluate_fn()

    def state_dict(self) -> dict:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.freq_ctl.load_state_dict(state)
