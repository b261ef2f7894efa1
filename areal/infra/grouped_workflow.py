"""``GroupedRolloutWorkflow``: run one episode ``group_size`` times and merge the group.

This is how a prompt becomes a group of ``n`` samples: the trainer wraps every workflow
with ``group_size = gconfig.n_samples`` (``eval_gconfig.n_samples`` for evaluation), as
AReaL does, and workflows generate one trajectory per call. Generic rollout machinery,
so it lives in ``areal.infra``; ``areal.workflow.grouped`` re-exports it (AReaL keeps the
class in ``areal.infra.remote_inf_engine``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from areal.api.workflow_api import RolloutWorkflow
from areal.infra import workflow_context
from areal.utils import logging
from areal.utils.batch import concat_padded_tensors

if TYPE_CHECKING:
    from areal.api.engine_api import InferenceEngine

__all__ = ["GroupedRolloutWorkflow", "interactions_to_tensor_dict", "is_interaction_dict"]

logger = logging.getLogger("GroupedRolloutWorkflow")


def is_interaction_dict(x: Any) -> bool:
    """A non-empty dict whose values all expose ``to_tensor_dict()`` (agent interactions)."""
    return (
        isinstance(x, dict)
        and bool(x)
        and all(callable(getattr(v, "to_tensor_dict", None)) for v in x.values())
    )


def interactions_to_tensor_dict(traj: dict[str, Any]) -> dict[str, Any]:
    """Concatenate ``{id: interaction}`` (values with ``to_tensor_dict()``) into one padded batch.

    Interactions that report ``has_tensor_data == False`` (text-only records of an
    external API) cannot be trained on: a ``ValueError`` names them.
    """
    missing = [k for k, v in traj.items() if getattr(v, "has_tensor_data", True) is False]
    if missing:
        raise ValueError(
            f"{len(missing)} interaction(s) carry no token data (e.g. {missing[0]!r}); "
            "only interactions with token ids and logprobs can be trained on"
        )
    return concat_padded_tensors([v.to_tensor_dict() for v in traj.values()])


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Run ``workflow.arun_episode`` ``group_size`` times concurrently on the same data.

    Each member runs in its own task whose :mod:`~areal.infra.workflow_context` carries
    ``sample_index`` = its position in the group. Members returning ``None`` are left out
    (logged); if all do, the group is rejected (``None``). Tensor-dict results are
    concatenated along the batch dimension; dicts of interactions (values with
    ``to_tensor_dict()``) are merged into one dict. An exception in any member propagates
    (the executor counts the whole group as rejected).
    """

    def __init__(self, workflow: RolloutWorkflow, group_size: int, logger: Any = None):
        if group_size < 1:
            raise ValueError(f"group_size={group_size}; must be >= 1")
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow {type(workflow).__name__} has no arun_episode()")
        self.workflow = workflow
        self.group_size = int(group_size)
        self.logger = logger if logger is not None else globals()["logger"]

    async def _member(self, engine: InferenceEngine, data: dict[str, Any], index: int) -> Any:
        workflow_context.with_sample_index(index)
        return await self.workflow.arun_episode(engine, data)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        results = await asyncio.gather(
            *[self._member(engine, data, i) for i in range(self.group_size)]
        )
        kept = [r for r in results if r is not None]
        if not kept:
            return None
        if len(kept) < len(results):
            self.logger.warning(
                "%d/%d episodes of a group returned None; keeping the other %d",
                len(results) - len(kept),
                len(results),
                len(kept),
            )
        if all(is_interaction_dict(r) for r in kept):
            merged: dict[str, Any] = {}
            for r in kept:
                merged.update(r)
            return merged
        kept = [interactions_to_tensor_dict(r) if is_interaction_dict(r) else r for r in kept]
        if len(kept) == 1:
            return kept[0]
        return concat_padded_tensors(kept)
