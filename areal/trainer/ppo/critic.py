"""PPO value model: value prediction and the clipped value-regression update.

The critic engine is a :class:`TrainEngine` built with ``is_critic=True``: its
``forward_batch`` returns values ``[B, T]`` aligned like logprobs (``values[b, i]`` is the
value of the state in which token ``i`` is generated, i.e. of the prefix ``< i``), and in
``train_batch`` the first argument given to ``loss_fn`` is the packed values tensor.
:class:`PPOCriticHost` mixes a :class:`PPOCritic` into any such engine;
``FSDPPPOCritic(PPOCriticHost, FSDPEngine)`` is the workers' class.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from areal.api.engine_api import TrainEngine
from areal.engine.fsdp import FSDPEngine
from areal.utils import logging, stats_tracker
from areal.utils.data import select_sequences
from areal.utils.rl_losses import ppo_critic_loss_fn

logger = logging.getLogger("PPOCritic")

__all__ = [
    "PPOCritic",
    "PPOCriticHost",
    "FSDPPPOCritic",
    "ppo_critic_loss",
    "critic_loss_weight",
]

_TRAIN_KEYS = ("input_ids", "attention_mask", "loss_mask", "values", "returns")


class PPOCritic:
    """Clipped value regression over a critic :class:`TrainEngine`."""

    def __init__(self, config: Any, engine: TrainEngine):
        self.config = config
        self.engine = engine

    @torch.no_grad()
    def compute_values(self, data: dict[str, Any]) -> torch.Tensor:
        """Values ``[B, T]`` (token-aligned) under the current critic weights."""
        self.engine.eval()
        return self.engine.forward_batch(data)

    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        """``ppo_n_minibatches`` steps regressing ``values`` towards ``returns`` (from
        ``PPOActor.compute_advantages``), clipped to ``eps_clip`` around the old values."""
        cfg = self.config
        for key in ("values", "returns"):
            if key not in data:
                raise ValueError(f"critic ppo_update needs {key!r} in data")
        train_data = {k: data[k] for k in _TRAIN_KEYS}
        if cfg.mask_no_eos_with_zero:
            attn = data["attention_mask"].bool()
            no_eos = data.get("no_eos")
            if no_eos is None:
                no_eos = attn.sum(-1) == attn.shape[-1]
            train_data["loss_mask"] = data["loss_mask"] * (~no_eos.bool())[:, None]
        self.engine.train()
        bs = data["attention_mask"].shape[0]
        perm = torch.randperm(bs, device=data["attention_mask"].device)
        loss_fn = functools.partial(ppo_critic_loss, value_eps_clip=cfg.eps_clip)
        results = []
        with stats_tracker.scope("ppo_critic"):
            for idx in torch.tensor_split(perm, min(cfg.ppo_n_minibatches, bs)):
                mb = select_sequences(train_data, idx)
                stat = self.engine.train_batch(
                    mb, loss_fn=loss_fn, loss_weight_fn=critic_loss_weight
                )
                stats_tracker.scalar(**{k: float(v) for k, v in stat.items()})
                results.append(stat)
        return results


def critic_loss_weight(input_data: dict[str, Any]) -> torch.Tensor:
    return input_data["loss_mask"].count_nonzero()


def ppo_critic_loss(
    values: torch.Tensor,
    entropy: torch.Tensor | None,
    input_data: dict[str, Any],
    value_eps_clip: float,
) -> torch.Tensor:
    """Per-micro-batch critic loss for ``TrainEngine.train_batch`` (packed inputs)."""
    mask = input_data["loss_mask"].bool()
    loss, stat = ppo_critic_loss_fn(
        values, input_data["values"], input_data["returns"], value_eps_clip, mask
    )
    stats_tracker.denominator(n_valid_tokens=mask, clipped_value_tokens=stat["clip_mask"])
    stats_tracker.stat(
        value_loss=stat["loss"].float(),
        clip_ratio=stat["clip_mask"].float(),
        denominator="n_valid_tokens",
    )
    return loss


class PPOCriticHost:
    """Engine mixin: hosts a :class:`PPOCritic` (``compute_values`` / ``ppo_update``)."""

    critic: PPOCritic

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.critic = PPOCritic(config, self)

    @torch.no_grad()
    def compute_values(self, data: dict[str, Any]) -> torch.Tensor:
        return self.critic.compute_values(data)

    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        return self.critic.ppo_update(data)


class FSDPPPOCritic(PPOCriticHost, FSDPEngine):
    """FSDP engine (``is_critic=True``) hosting a :class:`PPOCritic`."""
