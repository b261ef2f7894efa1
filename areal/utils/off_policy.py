"""Off-policy (staleness) corrections of the decoupled PPO loss.

The behaviour policy that generated a token can be several versions older than the
proximal policy the ratio is clipped against:

- :func:`apply_rejection_sampling`: AReaL's ``rejection_sampling`` filter (mask or clamp
  tokens/sequences whose behaviour importance weight is out of bounds);
- :func:`loglinear_prox_logp`: the proximal logprobs approximated from the versions,
  without a recompute forward pass (``prox_logp_method="loglinear"``);
- :func:`m2po_loss_mask`: M2PO's second-moment trust mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from areal.utils.rl_statistics import (
    broadcast_to_tokens,
    kl_estimator,
    sequence_mean,
    sequence_reduce,
)

REJECTION_LEVELS = ("token", "sequence")
REJECTION_ACTIONS = ("mask", "clamp")
REJECTION_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl")
REJECTION_AGGS = ("sum", "mean", "max")


@dataclass
class RejectionSamplingResult:
    """Outcome of :func:`apply_rejection_sampling` (all per-token, shaped like the inputs).

    ``keep_mask``: loss tokens that stay in the loss (``loss_mask`` minus the rejected ones);
    ``behave_imp_weight``: the behaviour importance weight ``pi_prox / pi_behave`` after
    clamping, 0 outside ``keep_mask``; ``affected``: loss tokens that were rejected
    (``mask``) or whose weight was clamped (``clamp``); ``filtered_fraction``: scalar
    tensor, ``affected`` tokens / loss tokens.
    """

    keep_mask: torch.Tensor
    behave_imp_weight: torch.Tensor
    affected: torch.Tensor
    filtered_fraction: torch.Tensor


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KL between Bernoulli distributions ``[p, 1-p]`` and ``[q, 1-q]`` given ``log p``,
    ``log q`` (elementwise): ``p log(p/q) + (1-p) log((1-p)/(1-q))``, with ``p`` and ``q``
    clamped into ``[eps, 1 - eps]`` (KPop's per-token divergence)."""
    p = torch.exp(log_p.float()).clamp(eps, 1.0 - eps)
    q = torch.exp(log_q.float()).clamp(eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _rs_field(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def apply_rejection_sampling(
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
) -> RejectionSamplingResult:
    """Staleness filter of the decoupled loss (AReaL's ``rejection_sampling``).

    ``config`` has ``level``, ``action``, ``metric``, ``agg``, ``upper``, ``lower`` (a
    ``RejectionSamplingConfig``, any object or dict with those names). With
    ``log r = proximal - old`` per token (``r = pi_prox / pi_behave``; non-finite values
    count as 0) the metric is ``r`` (``ratio``), ``log r`` (``kl_k1``), ``(log r)^2 / 2``
    (``kl_k2``), ``1/r - 1 + log r`` (``kl_k3``: :func:`kl_estimator` ``k3`` of
    (proximal, old), as AReaL) or, for ``binary_kl`` (KPop), the larger of
    :func:`binary_kl` (proximal, old) and (old, proximal) of the token probabilities
    (0 where either logprob is not finite). A value is in bounds when ``<= upper`` and,
    if ``lower`` is set, ``>= lower``.

    * ``level="token"``: each loss token is judged on its own metric; its weight is ``r``.
    * ``level="sequence"``: the metric is aggregated over the loss tokens of each sequence
      (``agg``: ``sum`` / ``mean`` / ``max``; for ``ratio`` the aggregation is of ``log r``
      and exponentiated back: the product / geometric mean / largest ratio) and the whole
      sequence shares the decision. With ``ratio`` every token's weight is the
      sequence's geometric-mean ratio (GSPO-style); with KL metrics weights stay per token.
    * ``action="mask"``: out-of-bounds tokens (sequences) leave the loss (``keep_mask``);
      ``action="clamp"`` (``ratio`` only): their weight is clamped into
      ``[lower or 0, upper]`` and they stay.

    Packed 1-D inputs need ``cu_seqlens`` at sequence level.
    """
    level = _rs_field(config, "level", "token")
    action = _rs_field(config, "action", "mask")
    metric_name = _rs_field(config, "metric", "ratio")
    agg = _rs_field(config, "agg", "mean")
    upper = float(_rs_field(config, "upper", 5.0))
    lower = _rs_field(config, "lower", None)
    for name, value, allowed in (
        ("level", level, REJECTION_LEVELS),
        ("action", action, REJECTION_ACTIONS),
        ("metric", metric_name, REJECTION_METRICS),
        ("agg", agg, REJECTION_AGGS),
    ):
        if value not in allowed:
            raise ValueError(f"rejection_sampling.{name}={value!r}; allowed: {list(allowed)}")
    if action == "clamp" and metric_name != "ratio":
        raise ValueError(
            f"rejection_sampling.action='clamp' needs metric='ratio', got {metric_name!r}"
        )
    if proximal_logprobs.shape != old_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"shapes differ: proximal {tuple(proximal_logprobs.shape)}, old "
            f"{tuple(old_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if level == "sequence" and proximal_logprobs.dim() == 1 and cu_seqlens is None:
        raise ValueError("rejection_sampling.level='sequence' on packed inputs needs cu_seqlens")
    mask = loss_mask.bool()
    log_r = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_r = torch.where(mask & torch.isfinite(log_r), log_r, 0.0)
    if metric_name == "ratio":
        metric = log_r  # compared in log space: log r vs log(bound)
    elif metric_name == "binary_kl":
        prox, old = proximal_logprobs.detach().float(), old_logprobs.detach().float()
        finite = mask & torch.isfinite(prox) & torch.isfinite(old)
        prox, old = torch.where(finite, prox, 0.0), torch.where(finite, old, 0.0)
        metric = torch.maximum(binary_kl(prox, old), binary_kl(old, prox))
        metric = torch.where(finite, metric, 0.0)
    else:
        metric = kl_estimator(log_r, torch.zeros_like(log_r), metric_name[3:])
    weight = torch.exp(log_r)

    if level == "sequence":
        seq_metric = sequence_reduce(metric, mask, cu_seqlens, agg)
        metric = broadcast_to_tokens(seq_metric, log_r, cu_seqlens)
        if metric_name == "ratio":
            seq_log_w = sequence_mean(log_r, mask, cu_seqlens)
            weight = torch.exp(broadcast_to_tokens(seq_log_w, log_r, cu_seqlens))
    if metric_name == "ratio":
        metric = torch.exp(metric)
    in_bounds = metric <= upper
    if lower is not None:
        in_bounds = in_bounds & (metric >= float(lower))

    if action == "mask":
        keep = mask & in_bounds
        affected = mask & ~in_bounds
    else:
        lo = 0.0 if lower is None else float(lower)
        clamped = torch.where(in_bounds, weight, weight.clamp(min=lo, max=upper))
        affected = mask & (clamped != weight)
        weight = clamped
        keep = mask
    weight = torch.where(keep, weight, 0.0)
    frac = affected.sum().float() / mask.sum().clamp(min=1).float()
    return RejectionSamplingResult(
        keep_mask=keep, behave_imp_weight=weight, affected=affected, filtered_fraction=frac
    )


@torch.no_grad()
def loglinear_prox_logp(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    versions: torch.Tensor,
    proximal_version: int,
    update_progress: float = 0.0,
) -> torch.Tensor:
    """Log-linear approximation of the proximal logprobs (``prox_logp_method="loglinear"``).

    Assumes a token's log-probability moves linearly with the policy version between the
    behaviour policy (version ``v_b = versions``, logprob ``old_logprobs``) and the
    policy being trained (``logprobs``, version ``v_theta``)::

        alpha = (v_prox - v_b) / (v_theta - v_b)      clamped to [0, 1]
        prox  = old + alpha * (logprobs - old)

    ``proximal_version`` (``v_prox``) is the version of the weights the update started
    from, i.e. the weights a recompute would use; ``v_theta = v_prox + update_progress``
    where ``update_progress`` is the fraction of this update's optimizer steps already
    taken (minibatch index / number of minibatches). So tokens generated by the proximal
    weights (``v_b = v_prox``) get ``old`` exactly, and in the first minibatch
    (``update_progress = 0``, the weights are still the proximal ones) every older token
    gets ``logprobs`` exactly. Tokens with ``versions < 0`` (prompt) get ``old``.
    """
    v_b = versions.to(torch.float64)
    v_prox = float(proximal_version)
    v_theta = v_prox + float(update_progress)
    gap = v_theta - v_b
    generated = versions >= 0
    alpha = torch.where(generated & (gap > 0), (v_prox - v_b) / gap.clamp(min=1e-12), 0.0)
    alpha = alpha.clamp(0.0, 1.0).to(torch.float32)
    old = old_logprobs.detach().float()
    return old + alpha * (logprobs.detach().float() - old)


@torch.no_grad()
def m2po_loss_mask(
    old_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    m2_threshold: float,
) -> torch.Tensor:
    """M2PO second-moment trust mask (arXiv 2510.01161).

    With ``d_t = proximal - old`` (log importance weight of the stale behaviour policy),
    drop the tokens with the largest ``d_t^2`` until the mean of ``d^2`` over the kept
    tokens is ``<= m2_threshold``. Returns the new bool mask (the fewest tokens dropped).
    """
    if m2_threshold <= 0:
        raise ValueError(f"m2_threshold={m2_threshold}; must be > 0")
    mask = loss_mask.bool()
    d2 = (proximal_logprobs.float() - old_logprobs.float()).square()
    flat_mask = mask.reshape(-1)
    vals = d2.reshape(-1)[flat_mask]
    n = vals.numel()
    if n == 0:
        return mask
    sorted_vals, order = torch.sort(vals, descending=True)
    # suffix means: mean of sorted_vals[k:] for k = 0..n-1 (non-increasing in k)
    suffix_sum = torch.flip(torch.cumsum(torch.flip(sorted_vals.double(), [0]), 0), [0])
    counts = torch.arange(n, 0, -1, device=vals.device, dtype=torch.float64)
    ok = suffix_sum / counts <= m2_threshold
    # first k that satisfies the bound (all n dropped if none does, k = n)
    k = torch.where(ok.any(), ok.int().argmax(), torch.tensor(n, device=vals.device))
    keep_sorted = torch.arange(n, device=vals.device) >= k
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    new_flat = flat_mask.clone()
    new_flat[flat_mask] = keep
    return new_flat.view_as(mask)
