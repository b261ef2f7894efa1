"""Rewards to advantages: GAE, discounted returns and DAPO's overlong-reward penalty.

Padded ``[B, T]`` tensors, the loss mask marking the actions (response tokens); the
reward normalisation applied around these lives in :mod:`areal.utils.rl_statistics`.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over padded ``[B, T]`` tensors.

    Token ``t`` with ``loss_mask[b, t] = 1`` is an action; ``values[b, t]`` is the value of
    the state it was taken in and ``rewards[b, t]`` its reward. Positions outside the mask
    are skipped (the next action of ``t`` is the next masked position; the episode ends
    after the last one, with value 0)::

        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lam * A_next(t)

    Returns ``(advantages, returns = advantages + values)``, both 0 outside the mask.
    A reverse scan over time, vectorised over the batch.
    """
    mask = loss_mask.bool()
    r = rewards.float()
    v = values.float()
    bs, seqlen = r.shape
    adv = torch.zeros_like(r)
    next_value = torch.zeros(bs, dtype=r.dtype, device=r.device)
    last_gae = torch.zeros(bs, dtype=r.dtype, device=r.device)
    for t in range(seqlen - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        new_gae = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m, new_gae, 0.0)
        next_value = torch.where(m, v[:, t], next_value)
        last_gae = torch.where(m, new_gae, last_gae)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


@torch.no_grad()
def compute_returns(
    rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Discounted reward-to-go over the masked positions of ``[B, T]`` (GAE with V = 0, lam = 1)."""
    adv, _ = gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), loss_mask, gamma, 1.0)
    return adv


def reward_overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    overlong_tokens: int,
    overlong_penalty_factor: float,
    max_response_length: int,
) -> torch.Tensor:
    """DAPO soft overlong punishment added to sequence rewards ``[B]``.

    With ``L_max = max_response_length`` and cache ``L_c = overlong_tokens``: no penalty for
    ``|y| <= L_max - L_c``; ``((L_max - L_c) - |y|) / L_c * factor`` inside the cache;
    ``-factor`` beyond ``L_max``.
    """
    if overlong_tokens <= 0 or overlong_tokens > max_response_length:
        raise ValueError(
            f"overlong_tokens={overlong_tokens}; must be in [1, max_new_tokens={max_response_length}]"
        )
    expected = max_response_length - overlong_tokens
    lengths = response_lengths.to(torch.float32)
    penalty = ((expected - lengths) / overlong_tokens).clamp(min=-1.0, max=0.0)
    return rewards.float() + overlong_penalty_factor * penalty
