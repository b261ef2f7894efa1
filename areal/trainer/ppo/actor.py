"""PPO-family policy: logprob recomputation, advantages and the clipped-surrogate update.

``PPOActor(config, engine)`` is algorithm code on top of any :class:`TrainEngine`; every
algorithm preset (GRPO, PPO, DAPO, Dr.GRPO, LitePPO, RLOO, REINFORCE++, GSPO, SAPO, CISPO,
M2PO)
is a configuration of it. :class:`PPOActorHost` is the engine mixin that owns one and
exposes its worker calls; ``FSDPPPOActor(PPOActorHost, FSDPEngine)`` is what the
training workers host (the reference model is a frozen ``FSDPPPOActor`` used only for
``compute_logp``). Another training engine hosts the same code with one more line,
``class XPPOActor(PPOActorHost, XEngine)`` (see :mod:`areal.trainer.ppo`).

Data keys (padded ``[B, T]``, token-aligned, see the shared conventions):

* in: ``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs`` (behaviour policy),
  ``rewards`` ``[B]``; optional ``group_ids`` / ``episode_ids`` ``[B]`` (set by the
  rollout: group normalisation then groups rows by id and counts every episode once,
  see ``group_normalization``), ``versions``, ``prox_logp`` (recomputed by
  :meth:`PPOActor.compute_logp`; absent with ``prox_logp_method="loglinear"``, which
  approximates it inside the loss from ``versions``, and ``"reuse_train_logp"``, which
  takes the training forward pass's own detached logprobs), ``ref_logp`` (reference model),
  ``values`` (critic), ``teacher_logp`` with ``rl_loss_weight`` / ``distill_loss_weight``
  ``[B]`` (on-policy distillation, see :func:`distill_loss`),
  ``no_eos`` ``[B]`` bool (truncated responses; otherwise a response that fills the padded
  width counts as truncated), ``turn_ids`` ``[B, T]`` (turn of each loss token, for
  ``gae_timestep_unit="turn"``; default: each run of consecutive loss tokens is a turn).
* out of :meth:`PPOActor.compute_advantages`: ``advantages``, ``old_logp`` (behaviour),
  ``prox_logp`` (the policy the ratio is clipped against; left out in ``loglinear``
  mode), ``returns`` (when ``values``),
  ``kl_rewards``, ``tot_rewards`` ``[B, T]`` and ``task_rewards`` ``[B]`` (processed).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from areal.api.actor_config import PPOActorConfig
from areal.api.engine_api import TrainEngine
from areal.engine.fsdp import FSDPEngine
from areal.trainer.ppo.lambda_fn import per_sample_lambda, resolve_gae_lambda
from areal.utils import logging, stats_tracker
from areal.utils.advantages import (
    gae,
    reward_overlong_penalty,
    turn_gae,
    turn_ids_from_loss_mask,
)
from areal.utils.data import select_sequences
from areal.utils.off_policy import loglinear_prox_logp, m2po_loss_mask
from areal.utils.rl_losses import (
    LOSS_AGG_MODES,
    cispo_loss_fn,
    ppo_actor_loss_fn,
    sapo_loss_fn,
)
from areal.utils.rl_statistics import group_normalization, kl_estimator, sequence_index
from areal.utils.seeding import request_seed

logger = logging.getLogger("PPOActor")

__all__ = [
    "PPOActor",
    "PPOActorHost",
    "FSDPPPOActor",
    "grpo_loss_fn",
    "distill_loss",
    "loss_weight",
    "apply_norm",
    "dp_group_of",
]

# keys the loss needs; everything else stays out of the mini-batches
PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics", "reuse_train_logp")
# methods without a proximal forward pass: the loss makes prox_logp itself
_PROX_IN_LOSS = ("loglinear", "reuse_train_logp")

_TRAIN_KEYS = (
    "input_ids",
    "attention_mask",
    "loss_mask",
    "old_logp",
    "prox_logp",
    "advantages",
    "versions",
    "m2po_mask",
    "multi_modal_input",
    "teacher_logp",
    "rl_loss_weight",
    "distill_loss_weight",
    "routed_experts",  # MoE routing replay (rollout.return_routed_experts)
)


def dp_group_of(engine: Any) -> Any:
    """The engine's data-parallel group when torch.distributed runs with > 1 rank, else None."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        return engine.data_parallel_group
    except (NotImplementedError, AttributeError):
        return None


def apply_norm(
    x: torch.Tensor,
    norm: Any,
    mask: torch.Tensor | None = None,
    reduce_group: Any = None,
    group_ids: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply a ``NormConfig`` (``mean_level``, ``std_level``, ``mean_leave1out``,
    ``std_unbiased``, ``eps``, ``group_size``) to ``x``; ``None`` returns ``x`` unchanged.

    ``group_ids`` / ``episode_ids`` ``[B]``: groups by id instead of runs of
    ``norm.group_size`` rows, statistics over episodes (see ``group_normalization``)."""
    if norm is None:
        return x
    return group_normalization(
        x,
        mask,
        mean_level=norm.mean_level,
        std_level=norm.std_level,
        group_size=norm.group_size,
        mean_leave1out=norm.mean_leave1out,
        std_unbiased=norm.std_unbiased,
        eps=norm.eps,
        reduce_group=reduce_group,
        group_ids=group_ids,
        episode_ids=episode_ids,
    )


class PPOActor:
    """PPO/GRPO policy algorithm over a :class:`TrainEngine` (see the module docstring)."""

    def __init__(self, config: PPOActorConfig, engine: TrainEngine):
        self.config = config
        self.engine = engine
        self.loss_agg_mode = config.loss_agg_mode
        self.loss_norm_constant = config.loss_norm_constant
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"actor.loss_agg_mode={self.loss_agg_mode!r}; allowed: {list(LOSS_AGG_MODES)}"
            )
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_constant is None:
            self.loss_norm_constant = float(config.max_new_tokens)
        if config.use_sapo_loss and config.use_decoupled_loss:
            raise ValueError(
                "actor.use_sapo_loss=True is incompatible with actor.use_decoupled_loss=True; "
                "set actor.use_decoupled_loss=false"
            )
        if config.use_decoupled_loss and not config.recompute_logprob:
            raise ValueError("actor.use_decoupled_loss=True requires actor.recompute_logprob=True")
        self.prox_logp_method = config.prox_logp_method
        if self.prox_logp_method not in PROX_LOGP_METHODS:
            raise ValueError(
                f"actor.prox_logp_method={self.prox_logp_method!r}; allowed: "
                f"{list(PROX_LOGP_METHODS)}"
            )
        self._lambda_fn = resolve_gae_lambda(config.gae_lambda)
        # rejection sampling only acts on the decoupled loss (None: no behaviour weight)
        self.rejection_sampling = config.rejection_sampling if config.use_decoupled_loss else None

    # ------------------------------------------------------------------ logprobs
    @torch.no_grad()
    def compute_logp(self, data: dict[str, Any]) -> torch.Tensor:
        """Token logprobs ``[B, T]`` of ``data["input_ids"]`` under the current weights.

        The engine divides logits by its config ``temperature`` (set it to the rollout
        temperature so that the ratios compare like with like).
        """
        self.engine.eval()
        return self.engine.forward_batch(data)

    # ---------------------------------------------------------------- advantages
    @torch.no_grad()
    def compute_advantages(self, data: dict[str, Any]) -> dict[str, Any]:
        """Rewards -> per-token advantages (in place; also returned). See the module docstring."""
        cfg = self.config
        loss_mask = data["loss_mask"].bool()
        attn = data["attention_mask"].bool()
        bs, seqlen = loss_mask.shape
        device = loss_mask.device
        fmask = loss_mask.float()
        group = dp_group_of(self.engine)

        # ---- sequence rewards
        rewards = self._sequence_rewards(data, loss_mask, attn, group)
        group_ids = data.get("group_ids")

        # ---- logprobs: behaviour (old) and proximal
        behav = torch.where(loss_mask, data["logprobs"].float(), 0.0)
        prox = data.get("prox_logp")
        # loglinear: approximated inside the loss from the versions; reuse_train_logp: the
        # training forward's own logprobs (no proximal forward pass either way); a
        # recomputed prox_logp, when given anyway, is used by loglinear as it is (as AReaL)
        approx_prox = (
            cfg.use_decoupled_loss and self.prox_logp_method in _PROX_IN_LOSS and prox is None
        )
        if approx_prox and self.prox_logp_method == "loglinear" and data.get("versions") is None:
            raise ValueError(
                "actor.prox_logp_method='loglinear' needs per-token 'versions' in the batch"
            )
        if cfg.use_decoupled_loss:
            if prox is None and not approx_prox:
                raise ValueError(
                    "use_decoupled_loss=True but data has no 'prox_logp'; call compute_logp first "
                    "(or set actor.prox_logp_method='loglinear' / 'reuse_train_logp')"
                )
            old_logp = behav
        elif cfg.recompute_logprob and prox is not None:
            old_logp = prox.float()  # on-policy PPO with recomputed logprobs
        else:
            old_logp = behav
        prox = old_logp if prox is None or not cfg.use_decoupled_loss else prox.float()
        old_logp = torch.where(loss_mask, old_logp, 0.0)
        prox = torch.where(loss_mask, prox, 0.0)  # the behaviour logprobs when approximated

        # ---- token rewards: KL penalty + sequence reward on the last loss token
        kl_rewards = torch.zeros(bs, seqlen, device=device)
        ref_logp = data.get("ref_logp")
        if cfg.kl_ctl > 0 and ref_logp is not None:
            kl = kl_estimator(prox, ref_logp.float(), cfg.kl_estimator)
            kl_rewards = -cfg.kl_ctl * torch.where(loss_mask, kl, 0.0)
        positions = torch.arange(seqlen, device=device).expand(bs, seqlen)
        last_pos = torch.where(loss_mask, positions, -1).amax(-1)
        has_tokens = last_pos >= 0
        tot_rewards = kl_rewards.clone()
        rows = torch.arange(bs, device=device)
        tot_rewards[rows, last_pos.clamp(min=0)] += torch.where(has_tokens, rewards, 0.0)

        # ---- advantages
        values = data.get("values")
        simple = values is None and cfg.discount == 1.0 and not bool(kl_rewards.any())
        if simple:
            # no critic, no discount, no per-token rewards: every token gets its sequence reward
            # (per token or per turn alike)
            advantages = rewards[:, None] * fmask
        else:
            advantages, returns = self._gae(data, tot_rewards, kl_rewards, loss_mask)
            if values is not None:
                data["returns"] = returns
        advantages = apply_norm(
            advantages, cfg.adv_norm, mask=loss_mask, reduce_group=group, group_ids=group_ids
        )

        data["advantages"] = advantages.float()
        data["old_logp"] = old_logp
        if not approx_prox:
            data["prox_logp"] = prox
        data["kl_rewards"] = kl_rewards
        data["tot_rewards"] = tot_rewards
        data["task_rewards"] = rewards
        return data

    def _sequence_rewards(self, data, loss_mask, attn, group) -> torch.Tensor:
        """One reward per sequence: overlong penalty, bias / scale / clip, the reward
        normalisation (over groups of episodes), zero for a sequence without EOS when
        ``mask_no_eos_with_zero``."""
        cfg = self.config
        bs, seqlen = loss_mask.shape
        rewards = data["rewards"].float().reshape(bs)
        resp_len = loss_mask.sum(-1)
        if cfg.overlong_reward_penalty:
            rewards = reward_overlong_penalty(
                rewards,
                resp_len,
                overlong_tokens=cfg.overlong_tokens,
                overlong_penalty_factor=cfg.overlong_penalty_factor,
                max_response_length=cfg.max_new_tokens,
            )
        rewards = ((rewards + cfg.reward_bias) * cfg.reward_scaling).clamp(
            -cfg.reward_clip, cfg.reward_clip
        )
        # groups by id when the rollout tagged them (an agent episode may span several
        # rows, one per call): statistics over the episodes of a group, not its rows
        group_ids, episode_ids = data.get("group_ids"), data.get("episode_ids")
        rewards = apply_norm(
            rewards,
            cfg.reward_norm,
            reduce_group=group,
            group_ids=group_ids,
            episode_ids=episode_ids,
        )
        if cfg.mask_no_eos_with_zero:
            no_eos = data.get("no_eos")
            if no_eos is None:
                no_eos = attn.sum(-1) == seqlen
            rewards = torch.where(no_eos.bool().reshape(bs), 0.0, rewards)
        return rewards

    def _gae(self, data, tot_rewards, kl_rewards, loss_mask):
        """GAE per token or per turn (``gae_timestep_unit``); lambda (a number or one per
        sequence from the ``gae_lambda`` function) acts where a critic gives values, as
        the token-level rule always did (without one: lambda 1, discounted returns)."""
        cfg = self.config
        values = data.get("values")
        v = torch.zeros_like(tot_rewards) if values is None else values.float()
        turn_ids = data.get("turn_ids")
        if turn_ids is None:
            turn_ids = turn_ids_from_loss_mask(loss_mask)
        lam: float | torch.Tensor = 1.0
        if values is not None:
            lam = cfg.gae_lambda
            if self._lambda_fn is not None:
                lam = per_sample_lambda(
                    self._lambda_fn,
                    cfg.gae_lambda_kwargs,
                    loss_mask,
                    turn_ids,
                    cfg.gae_timestep_unit,
                )
        if cfg.gae_timestep_unit == "turn":
            # as AReaL: the outcome reward goes through turn GAE, the token KL penalty
            # stays a local per-token term of the advantage
            adv, returns = turn_gae(
                tot_rewards - kl_rewards, v, loss_mask, turn_ids, cfg.discount, lam
            )
            return adv + kl_rewards, returns
        return gae(tot_rewards, v, loss_mask, cfg.discount, lam)

    # ------------------------------------------------------------------- update
    def _dp_rank(self) -> int:
        try:
            return int(self.engine.data_parallel_rank)
        except (NotImplementedError, AttributeError):
            return 0

    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        """``ppo_n_minibatches`` optimizer steps over a shuffled split of ``data``.

        Returns the engine's stats of every step; all stats also go to ``stats_tracker``
        under ``ppo_actor/``.
        """
        cfg = self.config
        if "advantages" not in data:
            raise ValueError("ppo_update needs 'advantages'; call compute_advantages first")
        with stats_tracker.scope("ppo_actor"):
            self._log_batch_stats(data)
        self.engine.train()
        bs = data["attention_mask"].shape[0]
        n_mbs = min(cfg.ppo_n_minibatches, bs)
        try:
            current_version = self.engine.get_version()
        except (NotImplementedError, AttributeError):
            current_version = None
        # Mini-batch shuffle from a generator seeded by (base seed, version, rank) when a
        # base seed is set: reproducible across a crash and resume.
        gen = None
        step_seed = request_seed("ppo_minibatch_shuffle", current_version, self._dp_rank())
        if step_seed is not None:
            gen = torch.Generator().manual_seed(step_seed)
        perm = torch.randperm(bs, generator=gen).to(data["attention_mask"].device)
        train_data = {k: data[k] for k in _TRAIN_KEYS if k in data}
        prox_method = self.prox_logp_method if cfg.use_decoupled_loss else "recompute"
        approx_prox = prox_method in _PROX_IN_LOSS and (
            "prox_logp" not in data or prox_method == "reuse_train_logp"
        )
        if approx_prox and prox_method == "loglinear" and current_version is None:
            raise ValueError(
                "actor.prox_logp_method='loglinear' needs the engine's policy version "
                "(engine.get_version())"
            )
        m2_threshold = cfg.m2_threshold
        loss_fn = functools.partial(
            grpo_loss_fn,
            eps_clip=cfg.eps_clip,
            eps_clip_higher=cfg.eps_clip_higher,
            c_clip=cfg.c_clip,
            rejection_sampling=self.rejection_sampling,
            importance_sampling_level=cfg.importance_sampling_level,
            use_sapo_loss=cfg.use_sapo_loss,
            use_cispo_loss=cfg.use_cispo_loss,
            sapo_tau_pos=cfg.sapo_tau_pos,
            sapo_tau_neg=cfg.sapo_tau_neg,
            use_decoupled_loss=cfg.use_decoupled_loss,
            loss_agg_mode=self.loss_agg_mode,
            loss_norm_constant=self.loss_norm_constant,
            current_version=current_version,
            prox_logp_method=prox_method,
            # loglinear / reuse: the M2PO mask needs the loss-made prox
            m2_threshold=m2_threshold if approx_prox else None,
        )
        weight_fn = functools.partial(loss_weight, loss_agg_mode=self.loss_agg_mode)
        results = []
        with stats_tracker.scope("ppo_actor"), stats_tracker.scope("update"):
            for j, idx in enumerate(torch.tensor_split(perm, n_mbs)):
                mb = select_sequences(train_data, idx)
                if m2_threshold is not None and not approx_prox:
                    mb["m2po_mask"] = m2po_loss_mask(
                        mb["old_logp"], mb["prox_logp"], mb["loss_mask"], m2_threshold
                    )
                # the weights have taken j of this update's n_mbs optimizer steps
                mb_loss_fn = functools.partial(loss_fn, update_progress=j / n_mbs)
                stat = self.engine.train_batch(mb, loss_fn=mb_loss_fn, loss_weight_fn=weight_fn)
                stats_tracker.scalar(**{k: float(v) for k, v in stat.items()})
                results.append(stat)
        return results

    def _log_batch_stats(self, data: dict[str, Any]) -> None:
        loss_mask = data["loss_mask"].bool()
        attn = data["attention_mask"].bool()
        seqlens = attn.sum(-1).float()
        raw = data["rewards"].float().reshape(-1)
        # the rollout's own flag (generation hit its length limit); the padded width only
        # when a workflow does not send it (AReaL's rule: also counts the batch's longest)
        no_eos = data.get("no_eos")
        no_eos = (seqlens == attn.shape[-1]) if no_eos is None else no_eos.bool().reshape(-1)
        stats_tracker.denominator(
            n_seqs=torch.ones_like(raw, dtype=torch.bool),
            n_valid_tokens=loss_mask,
            correct_n_seqs=raw > 0,
            incorrect_n_seqs=raw <= 0,
        )
        stats_tracker.stat(
            task_reward=raw,
            seq_len=seqlens,
            prompt_len=seqlens - loss_mask.sum(-1).float(),
            no_eos_ratio=no_eos.float(),
            denominator="n_seqs",
        )
        stats_tracker.stat(correct_seq_len=seqlens, denominator="correct_n_seqs")
        stats_tracker.stat(incorrect_seq_len=seqlens, denominator="incorrect_n_seqs")
        tok = dict(advantages=data["advantages"].float())
        for k in ("kl_rewards", "tot_rewards", "returns", "values"):
            if k in data:
                tok[k] = data[k].float()
        stats_tracker.stat(**tok, denominator="n_valid_tokens")


def loss_weight(input_data: dict[str, Any], loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Micro-batch weight matching :func:`aggregate_token_loss`: loss tokens, or sequences
    that have loss tokens for the sequence-mean modes."""
    mask = input_data["loss_mask"].bool()
    if loss_agg_mode == "token-mean":
        return mask.count_nonzero()
    cu = input_data["cu_seqlens"]
    idx = sequence_index(cu, mask.numel())
    per_seq = torch.zeros(cu.numel() - 1, dtype=torch.long, device=mask.device)
    per_seq.index_add_(0, idx, mask.long())
    return (per_seq > 0).count_nonzero()


def grpo_loss_fn(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    input_data: dict[str, Any],
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: Any = None,
    importance_sampling_level: str = "token",
    use_sapo_loss: bool = False,
    use_cispo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    use_decoupled_loss: bool = False,
    loss_agg_mode: str = "token-mean",
    loss_norm_constant: float | None = None,
    current_version: int | None = None,
    prox_logp_method: str = "recompute",
    update_progress: float = 0.0,
    m2_threshold: float | None = None,
) -> torch.Tensor:
    """Per-micro-batch actor loss for ``TrainEngine.train_batch`` (packed 1-D inputs).

    ``prox_logp_method="loglinear"``: ``input_data`` has no ``prox_logp``; it is
    approximated here by :func:`~areal.utils.functional.loglinear_prox_logp` from
    ``old_logp``, the current ``logprobs``, ``versions`` and ``current_version`` (the
    version the update started from) advanced by ``update_progress``; ``m2_threshold``
    then builds the M2PO mask from the approximation (per micro-batch).
    ``"reuse_train_logp"``: the proximal logprobs are this forward pass's own ``logprobs``,
    detached (any ``prox_logp`` in the batch is ignored, as AReaL; one mini-batch, so the
    weights are still the update-start ones). ``use_cispo_loss``: :func:`cispo_loss_fn`
    instead of the clipped surrogate.
    ``"metrics"``: the recomputed ``prox_logp`` is used and the approximation's error
    against it is logged under ``compute_logp/``.
    """
    mask = input_data["loss_mask"].bool()
    old_logp = input_data["old_logp"]
    versions = input_data.get("versions")
    prox_gt = input_data.get("prox_logp")
    prox_logp, keep = _proximal_logp(
        logprobs,
        old_logp,
        mask,
        prox_gt,
        versions,
        input_data.get("m2po_mask"),
        prox_logp_method,
        current_version,
        update_progress,
        m2_threshold,
    )
    loss, stat = _policy_loss(
        logprobs,
        prox_logp,
        old_logp,
        input_data["advantages"],
        mask,
        keep,
        cu_seqlens=input_data.get("cu_seqlens"),
        eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        rejection_sampling=rejection_sampling if use_decoupled_loss else None,
        importance_sampling_level=importance_sampling_level,
        use_sapo_loss=use_sapo_loss,
        use_cispo_loss=use_cispo_loss,
        use_decoupled_loss=use_decoupled_loss,
        sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg,
        loss_agg_mode=loss_agg_mode,
        loss_norm_constant=loss_norm_constant,
    )
    teacher_logp = input_data.get("teacher_logp")
    rkl = None
    if teacher_logp is not None:
        loss, rkl = distill_loss(
            loss,
            logprobs,
            old_logp,
            teacher_logp,
            mask,
            _first(input_data.get("rl_loss_weight"), 1.0),
            _first(input_data.get("distill_loss_weight"), 0.005),
        )
    _record_actor_stats(
        stat, logprobs, entropy, old_logp, mask, keep, rkl, versions, current_version
    )
    if prox_logp_method in ("loglinear", "metrics") and versions is not None:
        _log_prox_approx_stats(
            prox_logp_method,
            prox_gt,
            old_logp,
            logprobs,
            prox_logp,
            versions,
            current_version,
            update_progress,
            mask,
        )
    return loss


def _proximal_logp(
    logprobs, old_logp, mask, prox_gt, versions, keep, method, current_version, progress, m2
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(proximal logprobs, M2PO keep mask) of one micro-batch (``grpo_loss_fn``'s
    docstring): this pass's own detached logprobs, the log-linear approximation, or the
    batch's recomputed ``prox_logp`` (the behaviour logprobs without one)."""
    if method == "reuse_train_logp":
        prox_logp = logprobs.detach().float()
    elif method == "loglinear" and prox_gt is None:
        if versions is None or current_version is None:
            raise ValueError(
                "prox_logp_method='loglinear' needs 'versions' in the batch and current_version"
            )
        prox_logp = loglinear_prox_logp(old_logp, logprobs, versions, current_version, progress)
        if not bool(torch.isfinite(torch.where(mask, prox_logp, 0.0)).all()):
            raise ValueError("loglinear proximal logprobs are not finite (check 'logprobs')")
    else:
        return (old_logp if prox_gt is None else prox_gt), keep
    if m2 is not None and keep is None:
        keep = m2po_loss_mask(old_logp, prox_logp, mask, m2)
    return prox_logp, keep


def _policy_loss(
    logprobs,
    prox_logp,
    old_logp,
    advantages,
    mask,
    keep,
    *,
    cu_seqlens,
    eps_clip,
    eps_clip_higher,
    c_clip,
    rejection_sampling,
    importance_sampling_level,
    use_sapo_loss,
    use_cispo_loss,
    use_decoupled_loss,
    sapo_tau_pos,
    sapo_tau_neg,
    loss_agg_mode,
    loss_norm_constant,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss the config names: CISPO, SAPO or the clipped PPO surrogate."""
    agg = dict(
        cu_seqlens=cu_seqlens,
        loss_agg_mode=loss_agg_mode,
        loss_norm_constant=loss_norm_constant,
        token_keep_mask=keep,
    )
    if use_cispo_loss:
        if use_sapo_loss:
            raise ValueError("actor.use_cispo_loss and actor.use_sapo_loss are mutually exclusive")
        return cispo_loss_fn(
            logprobs,
            prox_logp,
            old_logp,
            advantages,
            eps_clip,
            eps_clip_higher,
            mask,
            rejection_sampling=rejection_sampling,
            **agg,
        )
    if use_sapo_loss:
        if use_decoupled_loss:
            raise ValueError(
                "actor.use_sapo_loss=True is incompatible with actor.use_decoupled_loss=True"
            )
        return sapo_loss_fn(
            logprobs,
            prox_logp,
            advantages,
            sapo_tau_pos,
            sapo_tau_neg,
            mask,
            importance_sampling_level=importance_sampling_level,
            **agg,
        )
    return ppo_actor_loss_fn(
        logprobs,
        prox_logp,
        old_logp,
        advantages,
        eps_clip,
        mask,
        eps_clip_higher=eps_clip_higher,
        c_clip=c_clip,
        rejection_sampling=rejection_sampling,
        importance_sampling_level=importance_sampling_level,
        **agg,
    )


def _record_actor_stats(
    stat, logprobs, entropy, old_logp, mask, keep, rkl, versions, current_version
) -> None:
    """The micro-batch's per-token statistics (recorded lazily; reduced at export)."""
    stats_tracker.denominator(
        n_valid_tokens=mask,
        clipped_tokens=stat["clip_mask"],
        dual_clipped_tokens=stat["dual_clip_mask"],
    )
    tok = dict(
        importance_weight=stat["importance_weight"].float(),
        approx_kl=stat["approx_kl"].float(),
        new_logp=logprobs.detach().float(),
        old_logp=old_logp.float(),
        actor_loss=stat["loss"].float(),
        clip_ratio=stat["clip_mask"].float(),
        dual_clip_ratio=stat["dual_clip_mask"].float(),
    )
    if entropy is not None:
        tok["entropy"] = entropy.detach().float()
    if rkl is not None:
        tok["rkl_loss"] = rkl.float()
    if keep is not None:
        tok["m2po_kept_ratio"] = keep.float()
    if "sapo_soft_gate" in stat:
        tok["sapo_soft_gate"] = stat["sapo_soft_gate"].float()
    if current_version is not None and versions is not None:
        tok["staleness"] = (current_version - versions).float()
    if "rs_affected" in stat:
        # rejected (mask) or clamped (clamp) share of the loss tokens
        tok["rs_filtered_fraction"] = stat["rs_affected"].float()
    stats_tracker.stat(**tok, denominator="n_valid_tokens")
    if "behave_mask" in stat:
        stats_tracker.denominator(unclipped_behave_tokens=stat["behave_mask"])
        stats_tracker.stat(
            behave_imp_weight=stat["behave_imp_weight"].float(),
            behave_approx_kl=stat["behave_approx_kl"].float(),
            denominator="unclipped_behave_tokens",
        )


def _first(value: Any, default: float) -> float:
    """A per-sequence weight column (all rows equal) or a scalar, as a float."""
    if value is None:
        return default
    if torch.is_tensor(value):
        return float(value.reshape(-1)[0]) if value.numel() else default
    return float(value)


def distill_loss(
    rl_loss: torch.Tensor,
    logprobs: torch.Tensor,
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    rl_loss_weight: float = 1.0,
    distill_loss_weight: float = 0.005,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation by reverse KL to a teacher (AReaL's semantics).

    ``rl_loss_weight > 0`` (KDRL, joint): ``rl_loss_weight * rl_loss + distill_loss_weight *
    mean(logprobs - teacher_logp)`` over the loss tokens (a direct penalty; its
    expectation under the student's samples is ``KL(student || teacher)``).

    ``rl_loss_weight == 0`` (pure distillation): the RL loss is dropped and the reverse KL
    is minimised as REINFORCE with the per-token reward ``teacher_logp - logprobs``
    (no gradient through the reward) weighted by ``exp(logprobs - old_logp)`` (importance
    sampling from the behaviour policy): ``-distill_loss_weight * mean(w * reward)``.

    Returns the loss and the per-token reverse-KL term (for the ``rkl_loss`` stat).
    """
    fmask = mask.float()
    n = fmask.sum().clamp(min=1)
    teacher_logp = teacher_logp.detach().float()
    if rl_loss_weight == 0:
        reward = teacher_logp - logprobs.detach()
        term = torch.exp(logprobs - old_logp) * reward * fmask
        return -distill_loss_weight * term.sum() / n, (-term).detach()
    penalty = (logprobs - teacher_logp) * fmask
    return rl_loss_weight * rl_loss + distill_loss_weight * penalty.sum() / n, penalty.detach()


def _log_prox_approx_stats(
    method: str,
    prox_gt: torch.Tensor | None,
    old_logp: torch.Tensor,
    logprobs: torch.Tensor,
    prox_used: torch.Tensor,
    versions: torch.Tensor,
    current_version: int | None,
    update_progress: float,
    mask: torch.Tensor,
) -> None:
    """``compute_logp/`` stats of the proximal approximation (loglinear: the values used;
    metrics: also the errors of loglinear and of plain behaviour logprobs vs the truth)."""
    if current_version is None:
        return
    approx = (
        prox_used
        if method == "loglinear"
        else loglinear_prox_logp(old_logp, logprobs, versions, current_version, update_progress)
    )
    old = old_logp.detach().float()
    tok = {
        "loglinear/approx_logp": approx,
        "loglinear/behave_imp_weight": torch.exp(approx - old),
        "loglinear/importance_weight": torch.exp(logprobs.detach().float() - approx),
    }
    if prox_gt is not None:
        gt = prox_gt.detach().float()
        tok["prox_logp_gt"] = gt
        tok["loglinear/abs_error"] = (approx - gt).abs()
        tok["rollout/abs_error"] = (old - gt).abs()
    with stats_tracker.scope("compute_logp"):
        stats_tracker.denominator(n_valid_tokens=mask)
        stats_tracker.stat(
            **{k: torch.where(mask, v, 0.0) for k, v in tok.items()}, denominator="n_valid_tokens"
        )


class PPOActorHost:
    """Engine mixin: hosts a :class:`PPOActor` and exposes its worker calls.

    Mixed in before a :class:`TrainEngine` (``class XPPOActor(PPOActorHost, XEngine)``):
    the engine is built first, then ``self.actor = PPOActor(config, self)``; the
    controller's ``compute_logp`` / ``compute_advantages`` / ``ppo_update`` calls land on
    these methods.
    """

    actor: PPOActor

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.actor = PPOActor(config, self)

    @torch.no_grad()
    def compute_logp(self, data: dict[str, Any]) -> torch.Tensor:
        return self.actor.compute_logp(data)

    @torch.no_grad()
    def compute_advantages(self, data: dict[str, Any]) -> dict[str, Any]:
        return self.actor.compute_advantages(data)

    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        return self.actor.ppo_update(data)


class FSDPPPOActor(PPOActorHost, FSDPEngine):
    """FSDP engine hosting a :class:`PPOActor` (the training workers' actor/ref model)."""
