"""DAPO dynamic sampling: keep only the groups whose rewards are not all equal.

:func:`dynamic_sampling_accept` is the rollout's ``should_accept_fn`` (one group at a
time); :func:`uniform_reward_group_mask` is the batched form over a whole batch.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.utils.rl_statistics import episode_first_rows


def uniform_reward_group_mask(
    rewards: torch.Tensor,
    group_size: int = 1,
    group_ids: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[B]``: True for rows whose group has non-identical rewards, i.e. rows that
    DAPO dynamic sampling keeps.

    Groups are runs of ``group_size`` consecutive rows, or the rows sharing a
    ``group_ids`` value. With ``episode_ids`` the rewards compared are the episodes'
    (the reward of each episode's first row, its return from the first call), so the
    discounted rewards of an episode's earlier calls do not make a group look mixed.
    """
    rewards = rewards.reshape(-1)
    if group_ids is None:
        if episode_ids is not None:
            raise ValueError("episode_ids needs group_ids")
        if rewards.numel() % group_size != 0:
            raise ValueError(
                f"group_size={group_size} does not divide the batch size {rewards.numel()}"
            )
        g = rewards.reshape(-1, group_size)
        keep = (g.amax(-1) != g.amin(-1)).repeat_interleave(group_size)
        return keep
    _, g_of_row = torch.unique(torch.as_tensor(group_ids).reshape(-1), return_inverse=True)
    n_groups = int(g_of_row.max()) + 1 if g_of_row.numel() else 0
    values, owner = rewards, g_of_row
    if episode_ids is not None:
        first, _ = episode_first_rows(episode_ids)
        values, owner = rewards[first], g_of_row[first]
    hi = torch.full((n_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    lo = torch.full((n_groups,), float("inf"), dtype=values.dtype, device=values.device)
    hi = hi.scatter_reduce(0, owner, values, reduce="amax")
    lo = lo.scatter_reduce(0, owner, values, reduce="amin")
    return (hi != lo)[g_of_row]


def dynamic_sampling_accept(trajectory: dict[str, Any]) -> bool:
    """``should_accept_fn`` for DAPO dynamic sampling: reject a group whose rewards are all equal.

    ``trajectory`` is one prompt's group (padded dict with ``rewards`` ``[G]``). With
    ``episode_ids`` (an agent's calls exported as one row each) the episodes' rewards
    are compared: the reward of each episode's first row (its return from the first
    call). A single sample (episode) is kept (nothing to compare). One host sync per group.
    """
    rewards = trajectory["rewards"]
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    rewards = rewards.reshape(-1)
    episode_ids = trajectory.get("episode_ids")
    if episode_ids is not None:
        first, _ = episode_first_rows(episode_ids)
        rewards = rewards[first]
    if rewards.numel() <= 1:  # no group to compare against: keep it
        return True
    return bool((rewards.amax() != rewards.amin()).item())
