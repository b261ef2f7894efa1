"""``RolloutWorkflow``: how one data item becomes trajectories."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from areal.api.engine_api import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """Subclass and implement ``arun_episode``.

    ``arun_episode`` must not block the event loop (no synchronous file or network I/O).
    It returns a padded tensor dict with a leading batch dimension (``input_ids``,
    ``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``, ``rewards``, ...), or
    ``None`` to reject the sample.
    """

    @abc.abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, torch.Tensor] | None: ...
