"""PPO-family losses: token-loss aggregation, the clipped policy surrogates and the value loss.

- :func:`aggregate_token_loss`: per-token losses to a micro-batch loss (``loss_agg_mode``);
- :func:`ppo_actor_loss_fn`: the decoupled clipped surrogate (clip-higher, dual clip,
  GSPO sequence ratios, rejection sampling from :mod:`areal.utils.off_policy`);
- :func:`sapo_loss_fn`: SAPO's soft gate;
- :func:`cispo_loss_fn`: CISPO's clipped, stop-gradient importance weight;
- :func:`ppo_critic_loss_fn`: the clipped value regression.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.utils.off_policy import apply_rejection_sampling
from areal.utils.rl_statistics import broadcast_to_tokens, sequence_mean, sequence_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_token_loss(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to the micro-batch loss.

    * ``token-mean``: mean over all masked tokens (weight the micro-batch by its token count).
    * ``seq-mean-token-mean``: token mean per sequence, then mean over sequences that have
      loss tokens (weight by that number of sequences).
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): token *sum* per sequence divided by the
      constant ``norm_constant`` (e.g. ``max_new_tokens``), mean over sequences.
    """
    mask = loss_mask.bool()
    if mode == "token-mean":
        total = torch.where(mask, token_loss, 0.0).sum()
        return total / mask.sum().clamp(min=1)
    n_tok = sequence_sum(mask.to(token_loss.dtype), mask, cu_seqlens)
    has_tokens = n_tok > 0
    n_seqs = has_tokens.sum().clamp(min=1)
    seq_sum = sequence_sum(token_loss, mask, cu_seqlens)
    if mode == "seq-mean-token-mean":
        return (seq_sum / n_tok.clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError(
                f"loss_agg_mode={mode!r} needs a positive norm constant, got {norm_constant}"
            )
        return seq_sum.sum() / (norm_constant * n_seqs)
    raise ValueError(f"loss_agg_mode={mode!r}; allowed: {list(LOSS_AGG_MODES)}")


def _sequence_ratio(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: per-sequence ratio ``exp(mean_t log r_t)`` and mean advantage, broadcast to tokens."""
    seq_log_ratio = sequence_mean(log_ratio, mask, cu_seqlens)
    seq_adv = sequence_mean(advantages, mask, cu_seqlens)
    ratio = torch.exp(broadcast_to_tokens(seq_log_ratio, log_ratio, cu_seqlens))
    adv = broadcast_to_tokens(seq_adv, advantages, cu_seqlens)
    return ratio, adv


def _check_is_level(level: str) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r}; allowed: ['token', 'sequence']")


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: Any = None,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_constant: float | None = None,
    token_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled clipped PPO surrogate (AReaL), with clip-higher, dual clip and GSPO.

    ``ratio = exp(logprobs - proximal_logprobs)`` (token) or the sequence geometric mean
    (``importance_sampling_level="sequence"``, GSPO; advantages are then averaged per
    sequence). Per token::

        L = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_higher))
        L = min(L, c_clip * |A|)            if c_clip (dual clip; binds only for A < 0)
        L = L * w                           w = behaviour importance weight

    ``rejection_sampling`` (a ``RejectionSamplingConfig``, see
    :func:`apply_rejection_sampling`) sets ``w = pi_prox / pi_behave`` (clamped by
    ``action="clamp"``) and removes rejected tokens (``action="mask"``); ``None`` applies
    no behaviour weight (``w = 1``) and filters nothing, as AReaL. Rejected tokens (and
    tokens where ``token_keep_mask`` is False, e.g. the M2PO mask) leave the loss — also
    the GSPO sequence ratio — but stay in its denominator, so the micro-batch weight is
    unchanged. The result is aggregated by ``loss_agg_mode`` (:func:`aggregate_token_loss`).

    Returns ``(loss, stats)``; stats hold per-token tensors: ``loss``,
    ``importance_weight``, ``approx_kl`` (``logprobs - proximal``), ``clip_mask``,
    ``dual_clip_mask`` and, with ``rejection_sampling``, ``behave_imp_weight``,
    ``behave_approx_kl``, ``behave_mask`` (tokens kept with a positive weight),
    ``rs_affected`` (rejected or clamped) and the scalar ``filtered_fraction``.
    """
    _check_is_level(importance_sampling_level)
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip={c_clip}; must be > 1.0 (or None to disable dual clip)")
    mask = loss_mask.bool()
    advantages = advantages.detach().float()
    prox = proximal_logprobs.detach().float()
    old = old_logprobs.detach().float()
    rs = None
    active = mask
    if rejection_sampling is not None:
        rs = apply_rejection_sampling(prox, old, mask, rejection_sampling, cu_seqlens)
        active = rs.keep_mask
    if token_keep_mask is not None:
        active = active & token_keep_mask.bool()
    log_ratio = logprobs.float() - prox
    log_ratio = torch.where(active, log_ratio, 0.0)
    if importance_sampling_level == "sequence":
        ratio, advantages = _sequence_ratio(log_ratio, advantages, active, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    ratio = torch.where(active, ratio, 0.0)
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    loss1 = -advantages * ratio
    loss2 = -advantages * clipped_ratio
    clip_mask = (loss1.detach() < loss2.detach()) & active
    pg_loss = torch.maximum(loss1, loss2)
    if c_clip is not None:
        loss3 = c_clip * advantages.abs()
        dual_clip_mask = (loss3 < pg_loss.detach()) & active
        pg_loss = torch.minimum(pg_loss, loss3)
    else:
        dual_clip_mask = torch.zeros_like(mask)
    if rs is not None:
        pg_loss = pg_loss * rs.behave_imp_weight
    pg_loss = torch.where(active, pg_loss, 0.0)

    loss = aggregate_token_loss(pg_loss, mask, loss_agg_mode, cu_seqlens, loss_norm_constant)
    stats = dict(
        loss=pg_loss.detach(),
        importance_weight=ratio.detach(),
        approx_kl=log_ratio.detach(),
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
    )
    if rs is not None:
        stats.update(_behave_stats(rs, active, prox, old))
    return loss, stats


def sapo_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: torch.Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_constant: float | None = None,
    token_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate replaces the hard clip (arXiv 2511.20347).

    ``L_t = -(4 / tau) * sigmoid(tau * (r_t - 1)) * A_t`` with ``tau = tau_pos`` for
    ``A_t > 0`` and ``tau_neg`` otherwise. The gradient w.r.t. ``log r`` is
    ``-4 s (1 - s) r A`` (``s`` the sigmoid): exactly ``-A`` at ``r = 1`` (like the
    unclipped surrogate) and decaying smoothly as ``r`` leaves 1. Not defined for the
    decoupled objective (the actor raises a config error).
    """
    _check_is_level(importance_sampling_level)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo_tau_pos={tau_pos}, sapo_tau_neg={tau_neg}; both must be > 0")
    mask = loss_mask.bool()
    advantages = advantages.detach().float()
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.detach().float(), 0.0)
    if importance_sampling_level == "sequence":
        ratio, advantages = _sequence_ratio(log_ratio, advantages, mask, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    keep = mask if token_keep_mask is None else mask & token_keep_mask.bool()
    token_loss = torch.where(keep, -gate * advantages, 0.0)
    loss = aggregate_token_loss(token_loss, mask, loss_agg_mode, cu_seqlens, loss_norm_constant)
    stats = dict(
        loss=token_loss.detach(),
        importance_weight=torch.where(mask, ratio, 0.0).detach(),
        approx_kl=log_ratio.detach(),
        clip_mask=torch.zeros_like(mask),
        dual_clip_mask=torch.zeros_like(mask),
        sapo_soft_gate=gate.detach(),
    )
    return loss, stats


def cispo_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_higher: float,
    loss_mask: torch.Tensor,
    rejection_sampling: Any = None,
    cu_seqlens: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_constant: float | None = None,
    token_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, MiniMax-M1's clipped IS-weight objective (arXiv 2506.13585, Eq. 4-5).

    Per token, with ``r = exp(logprobs - proximal_logprobs)``::

        L = -sg(clip(r, 1 - eps_clip, 1 + eps_clip_higher)) * A * logprobs
        L = L * w                           w = behaviour importance weight

    ``sg`` stops the gradient: unlike the PPO surrogate, a token whose ratio left the clip
    band keeps its gradient ``-clip(r) * A * grad(log pi)``; only its weight is bounded.
    Advantages are not clipped. ``rejection_sampling`` (decoupled loss), ``token_keep_mask``
    and ``loss_agg_mode`` act as in :func:`ppo_actor_loss_fn`. ``clip_mask`` marks the
    tokens whose ratio left the band (their loss is *not* zeroed).
    """
    if eps_clip_higher is None or eps_clip_higher <= 0:
        raise ValueError(
            f"eps_clip_higher={eps_clip_higher!r}; CISPO needs a positive upper clip of the "
            "IS weight"
        )
    mask = loss_mask.bool()
    advantages = advantages.detach().float()
    prox = proximal_logprobs.detach().float()
    rs = None
    active = mask
    if rejection_sampling is not None:
        rs = apply_rejection_sampling(
            prox, old_logprobs.detach().float(), mask, rejection_sampling, cu_seqlens
        )
        active = rs.keep_mask
    if token_keep_mask is not None:
        active = active & token_keep_mask.bool()
    log_ratio = torch.where(active, logprobs.detach().float() - prox, 0.0)
    ratio = torch.where(active, torch.exp(log_ratio), 0.0)
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_higher)
    pg_loss = -weight * advantages * logprobs.float()
    if rs is not None:
        pg_loss = pg_loss * rs.behave_imp_weight
    pg_loss = torch.where(active, pg_loss, 0.0)
    loss = aggregate_token_loss(pg_loss, mask, loss_agg_mode, cu_seqlens, loss_norm_constant)
    stats = dict(
        loss=pg_loss.detach(),
        importance_weight=ratio,
        approx_kl=log_ratio,
        clip_mask=(weight != ratio) & active,
        dual_clip_mask=torch.zeros_like(mask),
    )
    if rs is not None:
        stats.update(_behave_stats(rs, active, prox, old_logprobs.detach().float()))
    return loss, stats


def _behave_stats(rs, active, prox, old) -> dict[str, torch.Tensor]:
    """The decoupled loss's behaviour-policy statistics (rejection sampling's weights)."""
    behave_mask = active & (rs.behave_imp_weight > 0)
    return dict(
        behave_imp_weight=torch.where(active, rs.behave_imp_weight, 0.0),
        behave_approx_kl=torch.where(behave_mask, prox - old, 0.0),
        behave_mask=behave_mask,
        rs_affected=rs.affected,
        filtered_fraction=rs.filtered_fraction,
    )


def ppo_critic_loss_fn(
    value: torch.Tensor,
    old_value: torch.Tensor,
    target_value: torch.Tensor,
    value_eps_clip: float,
    loss_mask: torch.Tensor,
    loss_fn_type: str = "mse",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``max(l(V), l(V_old + clip(V - V_old, -eps, eps)))``, token mean.

    ``l`` is ``0.5 * (V - R)^2`` (``mse``) or the Huber loss with delta 10 (``huber``).
    """
    if loss_fn_type == "mse":

        def lf(x: torch.Tensor) -> torch.Tensor:
            return 0.5 * (x - target_value).square()
    elif loss_fn_type == "huber":

        def lf(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.huber_loss(x, target_value, reduction="none", delta=10.0)
    else:
        raise ValueError(f"loss_fn_type={loss_fn_type!r}; allowed: ['mse', 'huber']")
    mask = loss_mask.bool()
    value = value.float()
    target_value = target_value.detach().float()
    old_value = old_value.detach().float()
    loss_orig = lf(value)
    clipped = old_value + (value - old_value).clamp(-value_eps_clip, value_eps_clip)
    loss_clip = lf(clipped)
    token_loss = torch.maximum(loss_orig, loss_clip)
    clip_mask = (loss_clip.detach() > loss_orig.detach()) & mask
    loss = torch.where(mask, token_loss, 0.0).sum() / mask.sum().clamp(min=1)
    return loss, dict(loss=token_loss.detach(), clip_mask=clip_mask)
