"""Pure tensor RL ops, re-exported under one name (AReaL's ``areal.utils.functional``).

The code lives in modules by concern; import from them in new code:

- :mod:`areal.utils.rl_statistics`: KL estimators, per-sequence reductions over padded
  or packed tensors, masked / group normalisation (all-reduced across ranks);
- :mod:`areal.utils.advantages`: GAE, discounted returns, DAPO's overlong penalty;
- :mod:`areal.utils.off_policy`: staleness corrections (rejection sampling, the
  log-linear proximal approximation, the M2PO mask);
- :mod:`areal.utils.rl_losses`: token-loss aggregation, the PPO / SAPO / CISPO policy losses
  and the clipped value loss;
- :mod:`areal.utils.dynamic_sampling`: DAPO's all-equal-rewards group filter.

Everything is batched tensor code (no per-element host syncs). Per-token tensors are
aligned with the token they score: position ``i`` holds the value for ``input_ids[..., i]``
(see the shared tensor conventions).
"""

from __future__ import annotations

from areal.utils.advantages import compute_returns, gae, reward_overlong_penalty
from areal.utils.dynamic_sampling import dynamic_sampling_accept, uniform_reward_group_mask
from areal.utils.off_policy import (
    REJECTION_ACTIONS,
    REJECTION_AGGS,
    REJECTION_LEVELS,
    REJECTION_METRICS,
    RejectionSamplingResult,
    apply_rejection_sampling,
    binary_kl,
    loglinear_prox_logp,
    m2po_loss_mask,
)
from areal.utils.rl_losses import (
    LOSS_AGG_MODES,
    aggregate_token_loss,
    cispo_loss_fn,
    ppo_actor_loss_fn,
    ppo_critic_loss_fn,
    sapo_loss_fn,
)
from areal.utils.rl_statistics import (
    KL_ESTIMATORS,
    NORM_LEVELS,
    broadcast_to_tokens,
    episode_first_rows,
    group_normalization,
    kl_estimator,
    masked_normalization,
    regular_group_size,
    sequence_index,
    sequence_mean,
    sequence_reduce,
    sequence_sum,
)

__all__ = [
    "KL_ESTIMATORS",
    "NORM_LEVELS",
    "kl_estimator",
    "masked_normalization",
    "group_normalization",
    "gae",
    "compute_returns",
    "reward_overlong_penalty",
    "sequence_index",
    "sequence_sum",
    "sequence_mean",
    "sequence_reduce",
    "broadcast_to_tokens",
    "ppo_actor_loss_fn",
    "sapo_loss_fn",
    "cispo_loss_fn",
    "binary_kl",
    "m2po_loss_mask",
    "ppo_critic_loss_fn",
    "aggregate_token_loss",
    "LOSS_AGG_MODES",
    "REJECTION_LEVELS",
    "REJECTION_ACTIONS",
    "REJECTION_METRICS",
    "REJECTION_AGGS",
    "RejectionSamplingResult",
    "apply_rejection_sampling",
    "loglinear_prox_logp",
    "dynamic_sampling_accept",
    "uniform_reward_group_mask",
    "episode_first_rows",
    "regular_group_size",
]
