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


class AgentWorkflow(abc.ABC):
    """Base class of agent programs (kept for AReaL compatibility; subclassing is optional).

    ``PPOTrainer.train(workflow=...)`` accepts any object with
    ``async def run(self, data, **extra_kwargs) -> float | dict[str, float]``: the trainer
    opens a proxy session per episode and passes ``base_url``, ``api_key`` and
    ``http_client`` in ``extra_kwargs``; the returned float is the reward of the last
    completion (a dict maps completion ids to rewards). Subclassing warns, as AReaL's
    deprecated base class does.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        import warnings

        warnings.warn(
            f"{cls.__name__}: subclassing AgentWorkflow is deprecated and not required; "
            "any class with `async def run(self, data, **extra_kwargs)` is an agent",
            DeprecationWarning,
            stacklevel=2,
        )

    @abc.abstractmethod
    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float | dict[str, float]:
        """Run one episode against the OpenAI-compatible endpoint in ``extra_kwargs``."""
