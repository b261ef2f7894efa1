"""``GroupedRolloutWorkflow``: run one episode ``group_size`` times and merge the group.

This is how a prompt becomes a group of ``n`` samples: the trainer wraps every workflow
with ``group_size = gconfig.n_samples`` (``eval_gconfig.n_samples`` for evaluation), as
AReaL does, and workflows generate one trajectory per call. Generic rollout machinery,
so it lives in ``areal.infra``; ``areal.workflow.grouped`` re-exports it (AReaL keeps the
class in ``areal.infra.remote_inf_engine``; ``areal.infra.grouped_workflow`` is its old path here).

Episodes: the rows one ``arun_episode`` call returns form one *episode* (an agent whose
calls are exported one row each gives several). Every row of the group's result carries
``episode_ids`` ``[B]`` = the position of its episode in the group, so that group
statistics can count episodes, not rows; the executor then adds ``group_ids`` and makes
both unique in the batch (:func:`tag_group_rows`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from areal.api.workflow_api import RolloutWorkflow
from areal.infra.rollout import workflow_context
from areal.utils import logging
from areal.utils.batch import concat_padded_tensors

if TYPE_CHECKING:
    from areal.api.engine_api import InferenceEngine

__all__ = [
    "GroupInteractions",
    "GroupedRolloutWorkflow",
    "interactions_to_tensor_dict",
    "is_interaction_dict",
    "normalize_group_rewards",
    "tag_group_rows",
]

logger = logging.getLogger("GroupedRolloutWorkflow")


def is_interaction_dict(x: Any) -> bool:
    """A non-empty dict whose values all expose ``to_tensor_dict()`` (agent interactions)."""
    return (
        isinstance(x, dict)
        and bool(x)
        and all(callable(getattr(v, "to_tensor_dict", None)) for v in x.values())
    )


class GroupInteractions(dict):
    """The merged ``{id: interaction}`` of a group's episodes; ``episode_of[id]`` is the
    position in the group of the episode that made the interaction. A plain dict to
    everything else (AReaL returns the merged dict too)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.episode_of: dict[str, int] = {}


def _n_rows(batch: dict[str, Any]) -> int:
    for key in ("attention_mask", "input_ids"):
        if isinstance(batch.get(key), torch.Tensor):
            return int(batch[key].shape[0])
    return next(int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor))


def interactions_to_tensor_dict(traj: dict[str, Any]) -> dict[str, Any]:
    """Concatenate ``{id: interaction}`` (values with ``to_tensor_dict()``) into one padded batch.

    Rows carry ``episode_ids``: a :class:`GroupInteractions`' episode positions, else 0
    (the interactions of one episode). Interactions that report ``has_tensor_data ==
    False`` (text-only records of an external API) cannot be trained on: a ``ValueError``
    names them.
    """
    missing = [k for k, v in traj.items() if getattr(v, "has_tensor_data", True) is False]
    if missing:
        raise ValueError(
            f"{len(missing)} interaction(s) carry no token data (e.g. {missing[0]!r}); "
            "only interactions with token ids and logprobs can be trained on"
        )
    batch = concat_padded_tensors([v.to_tensor_dict() for v in traj.values()])
    episode_of = getattr(traj, "episode_of", {})
    batch["episode_ids"] = torch.tensor([episode_of.get(k, 0) for k in traj], dtype=torch.long)
    return batch


def _member_reward(result: Any) -> float | None:
    """One member's scalar reward: its last interaction's, or its last row's."""
    if is_interaction_dict(result):
        return getattr(result[next(reversed(result))], "reward", None)
    rewards = result.get("rewards") if isinstance(result, dict) else None
    if not isinstance(rewards, torch.Tensor) or rewards.numel() == 0:
        return None
    return float(rewards.reshape(-1)[-1])


def normalize_group_rewards(results: list[Any], log: Any = None) -> bool:
    """Replace each member's reward by ``(r - mean) / (std + 1e-8)`` over the group (in
    place; see :class:`GroupedRolloutWorkflow`). False (nothing changed) when a member has
    no reward."""
    rewards = [_member_reward(r) for r in results]
    if any(r is None for r in rewards):
        (log or logger).warning(
            "reward_normalization: dropping a group (%d/%d members without a reward)",
            sum(r is None for r in rewards),
            len(rewards),
        )
        return False
    t = torch.tensor(rewards, dtype=torch.float32)
    std = t.std(unbiased=False) if t.numel() > 1 else torch.tensor(1.0)
    normed = ((t - t.mean()) / (std + 1e-8)).tolist()
    for result, value in zip(results, normed):
        if is_interaction_dict(result):
            for inter in result.values():
                if getattr(inter, "reward", None) is not None:
                    inter.original_reward = inter.reward
                    inter.reward = value
        else:
            raw = result["rewards"]
            result["original_rewards"] = raw.clone()
            result["rewards"] = torch.full_like(raw, value, dtype=torch.float32)
    return True


def tag_group_rows(traj: dict[str, Any], group_id: int, first_episode_id: int) -> int:
    """Set ``group_ids`` (all ``group_id``) and batch-unique ``episode_ids`` on a padded
    result in place: its existing ``episode_ids`` (rows of one episode share a value; none:
    every row its own episode) are renumbered ``first_episode_id, first_episode_id + 1, ...``
    in order of value. Returns the number of episodes."""
    n = _n_rows(traj)
    local = traj.get("episode_ids")
    if isinstance(local, torch.Tensor) and local.shape[:1] == (n,):
        _, inverse = torch.unique(local.reshape(n), return_inverse=True)
    else:
        inverse = torch.arange(n)
    traj["group_ids"] = torch.full((n,), int(group_id), dtype=torch.long)
    traj["episode_ids"] = inverse.long() + int(first_episode_id)
    return int(inverse.max()) + 1 if n else 0


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Run ``workflow.arun_episode`` ``group_size`` times concurrently on the same data.

    Each member runs in its own task whose :mod:`~areal.infra.rollout.workflow_context` carries
    ``sample_index`` = its position in the group. Members returning ``None`` are left out
    (logged); if all do, the group is rejected (``None``). Tensor-dict results are
    concatenated along the batch dimension, each row with ``episode_ids`` = its member's
    position; dicts of interactions (values with ``to_tensor_dict()``) are merged into one
    :class:`GroupInteractions` dict that remembers each interaction's member. An exception
    in any member propagates (the executor counts the whole group as rejected).

    AReaL 2.0's options (``gconfig.drop_incomplete_group``, ``gconfig.reward_normalization``,
    ``rollout.serialize_group_samples``):

    * ``drop_incomplete_group``: a group with any ``None`` member is rejected whole;
    * ``reward_normalization``: each member's reward becomes ``(r - mean) / (std + 1e-8)``
      over the group (population std; members with several rows or interactions: the
      reward of their last one, applied to all of them); the raw reward is kept as
      ``original_rewards`` (tensor dicts) / ``interaction.original_reward``. A group with a
      missing member or reward is rejected (the statistics need the whole group);
    * ``serialize``: members run one after another (stable submission order) instead of
      concurrently.
    """

    def __init__(
        self,
        workflow: RolloutWorkflow,
        group_size: int,
        logger: Any = None,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
        serialize: bool = False,
    ):
        if group_size < 1:
            raise ValueError(f"group_size={group_size}; must be >= 1")
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow {type(workflow).__name__} has no arun_episode()")
        self.workflow = workflow
        self.group_size = int(group_size)
        self.logger = logger if logger is not None else globals()["logger"]
        self.reward_normalization = bool(reward_normalization)
        self.drop_incomplete_group = bool(drop_incomplete_group)
        self.serialize = bool(serialize)

    async def _member(self, engine: InferenceEngine, data: dict[str, Any], index: int) -> Any:
        workflow_context.with_sample_index(index)
        return await self.workflow.arun_episode(engine, data)

    async def _run_members(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Any]:
        if not self.serialize:
            return list(
                await asyncio.gather(
                    *[self._member(engine, data, i) for i in range(self.group_size)]
                )
            )
        out = []
        for i in range(self.group_size):  # each in its own task: its own workflow context
            out.append(await asyncio.create_task(self._member(engine, data, i)))
        return out

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        results = await self._run_members(engine, data)
        kept = [(i, r) for i, r in enumerate(results) if r is not None]
        if not kept:
            return None
        if len(kept) < len(results) and (self.drop_incomplete_group or self.reward_normalization):
            self.logger.warning(
                "%d/%d episodes of a group returned None; dropping the group (%s)",
                len(results) - len(kept),
                len(results),
                "drop_incomplete_group" if self.drop_incomplete_group else "reward_normalization",
            )
            return None
        if self.reward_normalization and self.group_size > 1:
            if not normalize_group_rewards([r for _, r in kept], self.logger):
                return None
        if len(kept) < len(results):
            self.logger.warning(
                "%d/%d episodes of a group returned None; keeping the other %d",
                len(results) - len(kept),
                len(results),
                len(kept),
            )
        if all(is_interaction_dict(r) for _, r in kept):
            merged = GroupInteractions()
            for i, r in kept:
                merged.update(r)
                merged.episode_of.update(dict.fromkeys(r, i))
            return merged
        parts = []
        for i, r in kept:
            part = dict(interactions_to_tensor_dict(r) if is_interaction_dict(r) else r)
            part["episode_ids"] = torch.full((_n_rows(part),), i, dtype=torch.long)
            parts.append(part)
        if len(parts) == 1:
            return parts[0]
        return concat_padded_tensors(parts)
