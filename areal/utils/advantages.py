"""Rewards to advantages: GAE (per token or per turn), discounted returns and DAPO's
overlong-reward penalty.

Padded ``[B, T]`` tensors, the loss mask marking the actions (response tokens); the
reward normalisation applied around these lives in :mod:`areal.utils.rl_statistics`.
``lam`` may be one float or one value per sequence (``[B]``, per-sample lambda, see
:mod:`areal.trainer.ppo.lambda_fn`).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
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
    decay = gamma * _per_row(lam, bs, r)
    for t in range(seqlen - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        new_gae = delta + decay * last_gae
        adv[:, t] = torch.where(m, new_gae, 0.0)
        next_value = torch.where(m, v[:, t], next_value)
        last_gae = torch.where(m, new_gae, last_gae)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


def _per_row(lam: float | torch.Tensor, bs: int, like: torch.Tensor) -> torch.Tensor:
    """``lam`` as a ``[B]`` float tensor (a float or a per-sequence tensor)."""
    out = torch.as_tensor(lam, dtype=like.dtype, device=like.device)
    if out.dim() == 0:
        return out.expand(bs)
    if out.shape != (bs,):
        raise ValueError(f"per-sample lambda has shape {tuple(out.shape)}; expected ({bs},)")
    return out


@torch.no_grad()
def turn_ids_from_loss_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Turn index of every loss token ``[B, T]`` (-1 elsewhere): each maximal run of
    consecutive loss tokens is one generated turn, numbered 0, 1, ... per row (prompt and
    tool-output tokens between them separate the turns)."""
    mask = loss_mask.bool()
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    starts = mask & ~prev
    ids = torch.cumsum(starts.long(), dim=1) - 1
    return torch.where(mask, ids, -1)


@torch.no_grad()
def turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with each generated *turn* one timestep (``gae_timestep_unit="turn"``).

    ``turn_ids[b, t]`` (integers, nondecreasing over the loss tokens of a row, -1 or
    anything outside the mask) groups the loss tokens into turns. A turn's reward is the
    sum of its tokens' rewards, its value the value at its first token; then over the
    turns ``k`` of a row (the episode ends after the last, value 0)::

        delta_k = R_k + gamma * V_{k+1} - V_k
        A_k     = delta_k + gamma * lam * A_{k+1}

    Every token of turn ``k`` gets ``A_k`` and the return ``A_k + V_k``; both are 0
    outside the mask. Discount and lambda thus act once per turn, not once per token.
    """
    mask = loss_mask.bool()
    bs, seqlen = mask.shape
    if turn_ids.shape != mask.shape:
        raise ValueError(
            f"turn_ids has shape {tuple(turn_ids.shape)}; expected {tuple(mask.shape)}"
        )
    ids = torch.where(mask, turn_ids.long(), -1)
    if bool((mask & (ids < 0)).any()):
        raise ValueError("turn_ids must be >= 0 at every loss token")
    running = torch.cummax(ids, dim=1).values
    if bool((mask & (ids < running)).any()):
        raise ValueError("turn_ids must not decrease along a sequence's loss tokens")
    # renumber each row's turns 0..n-1 in order (ids may skip values)
    new_turn = mask & (ids != torch.nn.functional.pad(running[:, :-1], (1, 0), value=-1))
    dense = torch.where(mask, torch.cumsum(new_turn.long(), 1) - 1, 0)
    n_turns = int(new_turn.sum(1).max()) if mask.any() else 0
    r = torch.where(mask, rewards.float(), 0.0)
    turn_r = torch.zeros(bs, max(n_turns, 1), dtype=r.dtype, device=r.device)
    turn_r.scatter_add_(1, dense, r)
    turn_v = torch.zeros_like(turn_r)
    first_v = torch.where(new_turn, values.float(), 0.0)
    turn_v.scatter_add_(1, dense, first_v)
    n_row = new_turn.sum(1, keepdim=True)
    turn_valid = torch.arange(turn_r.shape[1], device=r.device)[None] < n_row
    turn_adv, _ = gae(turn_r, turn_v, turn_valid, gamma, lam)
    adv = torch.where(mask, turn_adv.gather(1, dense), 0.0)
    returns = torch.where(mask, adv + turn_v.gather(1, dense), 0.0)
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
