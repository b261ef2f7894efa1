"""Frequency control for periodic actions (save, evaluate, checkpoint)."""

from __future__ import annotations

import time


class EpochStepTimeFreqCtl:
    """Fires when any of: ``freq_epoch`` epochs, ``freq_step`` steps or ``freq_sec`` seconds passed.

    ``None`` (or 0) disables a criterion. ``check(epochs=, steps=)`` is called once per
    training step with the number of epochs/steps just completed (usually 0/1 and 1).
    """

    def __init__(
        self,
        freq_epoch: int | None = None,
        freq_step: int | None = None,
        freq_sec: float | None = None,
    ):
        for name, v in (
            ("freq_epochs", freq_epoch),
            ("freq_steps", freq_step),
            ("freq_secs", freq_sec),
        ):
            if v is not None and v < 0:
                raise ValueError(f"{name}={v}; must be >= 0 or null")
        self.freq_epoch = freq_epoch or None
        self.freq_step = freq_step or None
        self.freq_sec = freq_sec or None
        self._epochs = 0
        self._steps = 0
        self._last_time = time.monotonic()

    def check(self, epochs: int = 0, steps: int = 0) -> bool:
        self._epochs += epochs
        self._steps += steps
        fire = False
        if self.freq_epoch is not None and self._epochs >= self.freq_epoch:
            fire = True
        if self.freq_step is not None and self._steps >= self.freq_step:
            fire = True
        now = time.monotonic()
        if self.freq_sec is not None and now - self._last_time >= self.freq_sec:
            fire = True
        if fire:
            self._epochs = 0
            self._steps = 0
            self._last_time = now
        return fire

    def state_dict(self) -> dict:
        return {
            "epochs": self._epochs,
            "steps": self._steps,
            "elapsed": time.monotonic() - self._last_time,
        }

    def load_state_dict(self, state: dict) -> None:
        self._epochs = state["epochs"]
        self._steps = state["steps"]
        self._last_time = time.monotonic() - state.get("elapsed", 0.0)
