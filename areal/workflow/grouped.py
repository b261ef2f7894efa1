"""``GroupedRolloutWorkflow``: run one episode ``group_size`` times and concatenate."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from areal.api.workflow_api import RolloutWorkflow
from areal.utils.batch import concat_padded_tensors

if TYPE_CHECKING:
    import torch

    from areal.api.engine_api import InferenceEngine


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Run ``workflow.arun_episode`` ``group_size`` times concurrently on the same data.

    Episodes that return ``None`` are left out; if all do, the group is rejected
    (``None``). An exception in any episode propagates (the executor counts the whole
    group as rejected).
    """

    def __init__(self, workflow: RolloutWorkflow, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size={group_size}; must be >= 1")
        self.workflow = workflow
        self.group_size = int(group_size)

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        results = await asyncio.gather(
            *[self.workflow.arun_episode(engine, data) for _ in range(self.group_size)]
        )
        kept = [r for r in results if r is not None]
        if not kept:
            return None
        if len(kept) == 1:
            return kept[0]
        return concat_padded_tensors(kept)
