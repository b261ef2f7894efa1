"""Direct Preference Optimization: loss, engine and controller.

Batches hold preference pairs as adjacent rows ``[chosen_0, rejected_0, ...]`` with a
``loss_mask`` on the response tokens (:func:`areal.trainer.preference.collate_pairs`).
With ``pi`` the policy, ``ref`` the frozen reference and ``log pi(y|x)`` the sum of the
response-token logprobs:

- ``sigmoid`` (DPO): ``h = [log pi(yc) - log ref(yc)] - [log pi(yr) - log ref(yr)]``,
  ``loss = -log sigmoid(beta * h)``.
- ``ipo`` (IPO, length-normalised as TRL and AReaL do): each log-ratio is divided by its
  number of response tokens, ``h = lr_c / |yc| - lr_r / |yr|``,
  ``loss = (h - 1 / (2 beta))^2``.

Metrics per pair: implicit rewards ``beta * (log pi - log ref)`` of chosen and rejected,
their margin and accuracy (chosen > rejected), the summed chosen/rejected logprobs.

The policy and its reference live in the same worker processes. :class:`DPOEngine` is
the algorithm over any policy engine and a frozen reference engine;
:class:`DPOEngineHost` mixes it into a policy engine and builds the reference (a
second, optimizer-less engine of its ``reference_engine_class`` on the same process
group) from the ``ref_config`` given to ``initialize``;
``FSDPDPOEngine(DPOEngineHost, FSDPEngine)`` is the workers' class (the hosting pattern
of :mod:`areal.trainer.ppo`). ``train_dpo`` computes the reference logprobs once per
batch, then takes one optimizer step over micro-batches of whole pairs. The pair
plumbing is :mod:`areal.trainer.pairs`, shared with the reward model.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from areal.engine.fsdp import FSDPEngine
from areal.trainer.pairs import (
    PairController,
    pair_loss_weight,
    train_pair_step,
    with_pair_granularity,
)
from areal.utils import logging, stats_tracker

logger = logging.getLogger("DPOEngine")

DPO_ENGINE = "areal.trainer.dpo.dpo_engine.FSDPDPOEngine"
DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_pair_logps(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked per-sequence sums over a packed micro-batch, paired up.

    ``logprobs[i]`` scores token ``i`` (this project's layout), so ``loss_mask`` needs no
    shift. Returns ``(policy, ref, n_tokens)``, each ``[n_pairs, 2]`` (float64 sums).
    """
    device = logprobs.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    n = lens.numel()
    if n % 2:
        raise ValueError(f"DPO micro-batch has {n} sequences; pairs need an even number")
    seq = torch.repeat_interleave(torch.arange(n, device=device), lens)
    m = loss_mask.to(device).bool()
    pol = torch.zeros(n, dtype=torch.float64, device=device)
    ref = torch.zeros(n, dtype=torch.float64, device=device)
    cnt = torch.zeros(n, dtype=torch.float64, device=device)
    pol = pol.index_add(0, seq, torch.where(m, logprobs, 0.0).double())
    ref = ref.index_add(0, seq, torch.where(m, ref_logprobs.to(device), 0.0).double())
    cnt = cnt.index_add(0, seq, m.double())
    return pol.view(-1, 2), ref.view(-1, 2), cnt.view(-1, 2)


def dpo_loss_from_logps(
    policy: torch.Tensor,
    ref: torch.Tensor,
    n_tokens: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> torch.Tensor:
    """Per-pair DPO/IPO loss from ``[n_pairs, 2]`` summed logprobs (module docstring)."""
    ratios = policy - ref
    if loss_type == "sigmoid":
        h = ratios[:, 0] - ratios[:, 1]
        return -torch.nn.functional.logsigmoid(beta * h)
    if loss_type == "ipo":
        avg = ratios / n_tokens.clamp(min=1)
        h = avg[:, 0] - avg[:, 1]
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"DPO loss_type={loss_type!r}; allowed: {list(DPO_LOSS_TYPES)}")


def compute_dpo_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    input_data: dict[str, Any],
    *,
    beta: float,
    loss_type: str = "sigmoid",
) -> torch.Tensor:
    """Mean DPO loss over the pairs of one packed micro-batch (needs ``ref_logp``)."""
    if "ref_logp" not in input_data:
        raise ValueError("DPO batch has no 'ref_logp' (reference logprobs)")
    pol, ref, cnt = dpo_pair_logps(
        logprobs, input_data["ref_logp"], input_data["loss_mask"], input_data["cu_seqlens"]
    )
    loss = dpo_loss_from_logps(pol, ref, cnt, beta, loss_type)
    with torch.no_grad():
        rewards = (beta * (pol - ref)).float()
        stats_tracker.denominator(n_pairs=torch.ones(rewards.shape[0], dtype=torch.bool))
        stats_tracker.stat(
            loss=loss.detach().float(),
            chosen_reward=rewards[:, 0],
            rejected_reward=rewards[:, 1],
            reward_accuracy=(rewards[:, 0] > rewards[:, 1]).float(),
            reward_margin=rewards[:, 0] - rewards[:, 1],
            chosen_logp=pol[:, 0].float(),
            rejected_logp=pol[:, 1].float(),
            denominator="n_pairs",
        )
    return loss.float().mean()


dpo_loss_weight = pair_loss_weight  # pairs in the micro-batch (the loss is a mean over pairs)


def dpo_pair_metrics(
    pair_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid"
) -> dict[str, float]:
    """Evaluation metrics from ``[n_pairs, 6]`` rows (policy c/r, ref c/r, tokens c/r).

    ``preference_accuracy``: share of pairs where the policy gives the chosen response
    a higher (summed) logprob than the rejected one; ``reward_accuracy``: share where the
    implicit reward of chosen is higher (0 while policy == reference).
    """
    p = pair_logps.double()
    pol, ref, cnt = p[:, 0:2], p[:, 2:4], p[:, 4:6]
    loss = dpo_loss_from_logps(pol, ref, cnt, beta, loss_type)
    rewards = beta * (pol - ref)
    return {
        "loss": float(loss.mean()),
        "preference_accuracy": float((pol[:, 0] > pol[:, 1]).double().mean()),
        "reward_accuracy": float((rewards[:, 0] > rewards[:, 1]).double().mean()),
        "reward_margin": float((rewards[:, 0] - rewards[:, 1]).mean()),
        "chosen_logp": float(pol[:, 0].mean()),
        "rejected_logp": float(pol[:, 1].mean()),
        "n_pairs": float(p.shape[0]),
    }


def _masked_pair_sums(
    logp: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    m = loss_mask.bool()
    s = torch.where(m, logp.double(), 0.0).sum(-1).view(-1, 2)
    return s, m.double().sum(-1).view(-1, 2)


class DPOEngine:
    """DPO over a policy :class:`~areal.api.engine_api.TrainEngine` and a frozen reference
    engine (``ref_engine``; any engine with ``forward_batch``)."""

    def __init__(self, engine: Any, ref_engine: Any = None):
        self.engine = engine
        self.ref_engine = ref_engine
        self.beta = float(engine.config.beta)
        self.loss_type = engine.config.loss_type
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(
                f"DPOEngineConfig.loss_type={self.loss_type!r}; allowed: {list(DPO_LOSS_TYPES)}"
            )

    def _loss_fn(self):
        return functools.partial(compute_dpo_loss, beta=self.beta, loss_type=self.loss_type)

    @torch.no_grad()
    def compute_ref_logp(self, data: dict[str, Any]) -> torch.Tensor:
        if self.ref_engine is None:
            raise RuntimeError("DPOEngine has no reference engine (pass ref_config)")
        return self.ref_engine.forward_batch(data)

    def train_dpo(self, data: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on a batch of pairs (reference logprobs computed here, once,
        unless the batch carries ``ref_logp``). Stats go to ``stats_tracker`` under ``dpo/``."""
        data = dict(data)
        if "ref_logp" not in data:
            data["ref_logp"] = self.compute_ref_logp(data)
        return train_pair_step(self.engine, data, self._loss_fn(), "dpo")

    @torch.no_grad()
    def evaluate_dpo(self, data: dict[str, Any]) -> torch.Tensor:
        """``[n_pairs, 6]`` (policy c/r, ref c/r summed logprobs, response tokens c/r)."""
        mask = data["loss_mask"]
        pol, cnt = _masked_pair_sums(self.engine.forward_batch(data), mask)
        ref_logp = data.get("ref_logp")
        if ref_logp is None:
            ref_logp = self.compute_ref_logp(data)
        ref, _ = _masked_pair_sums(ref_logp, mask)
        return torch.cat([pol, ref, cnt], dim=1)


class DPOEngineHost:
    """Engine mixin: hosts a :class:`DPOEngine` on a policy engine, with its frozen
    reference (an engine of ``reference_engine_class``) built at ``initialize`` from
    ``ref_config``; micro-batches hold whole pairs."""

    reference_engine_class: type
    dpo: DPOEngine

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(with_pair_granularity(config), *args, **kwargs)
        self.ref_engine: Any = None
        self.dpo = DPOEngine(self)

    def initialize(self, addr: str | None = None, ft_spec: Any = None, **kwargs: Any) -> None:
        ref_config = kwargs.pop("ref_config", None)
        super().initialize(addr=addr, ft_spec=ft_spec, **kwargs)
        if ref_config is not None:
            ref_config = with_pair_granularity(copy.copy(ref_config))
            ref_config.optimizer = None  # frozen
            self.ref_engine = self.reference_engine_class(ref_config)
            self.ref_engine.initialize(addr=addr, ft_spec=ft_spec, **kwargs)
            self.ref_engine.model.requires_grad_(False)
            self.dpo.ref_engine = self.ref_engine

    def destroy(self) -> None:
        if self.ref_engine is not None:
            self.ref_engine.destroy()
            self.ref_engine = None
        super().destroy()

    def train_dpo(self, data: dict[str, Any]) -> dict[str, float]:
        return self.dpo.train_dpo(data)

    def evaluate_dpo(self, data: dict[str, Any]) -> torch.Tensor:
        return self.dpo.evaluate_dpo(data)

    def compute_ref_logp(self, data: dict[str, Any]) -> torch.Tensor:
        return self.dpo.compute_ref_logp(data)


class FSDPDPOEngine(DPOEngineHost, FSDPEngine):
    """FSDP policy engine hosting a :class:`DPOEngine` and its FSDP reference model."""

    reference_engine_class = FSDPEngine


class DPOController(PairController):
    """``TrainController`` for DPO workers: whole pairs per rank."""

    def train_dpo(self, data: dict[str, Any]) -> dict[str, float]:
        return self.pair_call("train_dpo", data)

    def compute_ref_logp(self, data: dict[str, Any]) -> torch.Tensor:
        return self.pair_call("compute_ref_logp", data)

    def evaluate_dpo(self, data: dict[str, Any]) -> dict[str, float]:
        rows = torch.cat([r.reshape(-1, 6) for r in self.pair_call_per_rank("evaluate_dpo", data)])
        return dpo_pair_metrics(rows, float(self.config.beta), self.config.loss_type)
