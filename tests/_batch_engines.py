"""A PPO-shaped engine without a model, hosted by RPC workers in tests/test_batch_transfer.py.

Each method checks the keys the real ``PPOActor`` / ``PPOCritic`` would need, so a step
that forgot to hand the actor ``ref_logp`` or the critic ``returns`` fails.
"""

from __future__ import annotations

import torch


class StubPPOEngine:
    def __init__(self, config=None):
        self.config = config or {}
        self.updates = 0

    def configure(self, config: dict) -> None:
        self.config = config

    def initialize(self, addr=None, ft_spec=None, **kwargs) -> None:
        pass

    def destroy(self) -> None:
        pass

    def compute_logp(self, data: dict) -> torch.Tensor:
        return data["input_ids"].float() * 0.01 * data["attention_mask"]

    def compute_values(self, data: dict) -> torch.Tensor:
        return data["attention_mask"].float() * 0.5

    def compute_advantages(self, data: dict) -> dict:
        for key in self.config.get("needs", ()):
            if key not in data:
                raise KeyError(f"compute_advantages: no {key!r}")
        data["advantages"] = data["rewards"].float()[:, None] * data["loss_mask"]
        if "values" in data:
            data["returns"] = data["advantages"] + data["values"]
        return data

    def ppo_update(self, data: dict) -> list[dict[str, float]]:
        if self.config.get("fail_update"):
            raise RuntimeError("update failed on purpose")
        need = ("advantages",) if "returns" not in self.config.get("needs", ()) else ("returns",)
        for key in need:
            if key not in data:
                raise KeyError(f"ppo_update: no {key!r}")
        self.updates += 1
        adv = data[need[0]]
        ref = data.get("ref_logp") if "ref_logp" in self.config.get("needs", ()) else None
        return [
            {
                "adv_sum": float(adv.sum()),
                "ref_sum": float(ref.sum()) if ref is not None else 0.0,
                "rows": float(data["attention_mask"].shape[0]),
            }
        ]

    def step_lr_scheduler(self) -> None:
        pass
