"""Engine contracts: ``TrainEngine`` (trainer side) and ``InferenceEngine`` (rollout side).

Method names follow AReaL so that user code written against it runs here. Batches are
padded tensor dicts (``input_ids``, ``attention_mask`` ``[B, T]`` plus per-token or
per-sequence fields) unless a method says otherwise.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from areal.api.io_struct import (
        FinetuneSpec,
        ModelRequest,
        ModelResponse,
        ParamSpec,
        SaveLoadMeta,
        WeightUpdateMeta,
    )
    from areal.api.workflow_api import RolloutWorkflow


class TrainEngine(abc.ABC):
    """A model being trained (or a frozen reference/critic) sharded over data-parallel ranks."""

    # --- lifecycle -------------------------------------------------------------------
    def create_process_group(self, parallel_strategy: Any = None) -> None:
        """Initialise ``torch.distributed`` (gloo on CPU, NCCL on CUDA) if not yet done."""
        raise NotImplementedError

    @abc.abstractmethod
    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None, **kwargs) -> None:
        """Load the model, shard it, build the optimizer and LR scheduler."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Free the model and optimizer (and the process group if this engine made it)."""

    def train(self, mode: bool = True) -> TrainEngine:
        raise NotImplementedError

    def eval(self) -> TrainEngine:
        return self.train(False)

    # --- parallelism -----------------------------------------------------------------
    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        raise NotImplementedError

    @property
    def data_parallel_rank(self) -> int:
        raise NotImplementedError

    @property
    def data_parallel_world_size(self) -> int:
        raise NotImplementedError

    def is_data_parallel_head(self) -> bool:
        """True on the rank that speaks for its model-parallel group (rank 0 of it)."""
        raise NotImplementedError

    def current_data_parallel_head(self) -> int:
        return 0

    # --- compute ---------------------------------------------------------------------
    @abc.abstractmethod
    def train_batch(
        self,
        input_: dict[str, Any],
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor],
    ) -> dict[str, float]:
        """One optimizer step on ``input_``: split into micro-batches, accumulate, clip, step.

        ``loss_fn(logprobs, entropy, input_data) -> scalar`` sees one packed micro-batch;
        ``loss_weight_fn(mb)`` gives that micro-batch's weight (e.g. its number of loss
        tokens) so that the result does not depend on how the batch was split.
        Returns stats such as ``grad_norm`` and ``lr``.
        """

    @abc.abstractmethod
    def eval_batch(
        self,
        input_: dict[str, Any],
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor],
    ) -> torch.Tensor | None:
        """Weighted loss over ``input_`` without gradients."""

    @abc.abstractmethod
    def forward_batch(
        self,
        input_: dict[str, Any],
        output_seqlens: list[int] | None = None,
        post_hook: Callable[..., Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Forward without gradients; by default per-token logprobs of ``input_ids`` shaped like the input."""

    # --- optimizer -------------------------------------------------------------------
    def optimizer_zero_grad(self) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> dict[str, float]:
        raise NotImplementedError

    def step_lr_scheduler(self) -> None:
        raise NotImplementedError

    def scale_lr(self, factor: float) -> float:
        """Multiply the learning rate (and the LR schedule's base) by ``factor`` from now
        on; returns the new learning rate (run health's rollback)."""
        raise NotImplementedError

    # --- persistence and weight sync -------------------------------------------------
    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the current weights to the connected inference engine."""

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Remember the inference engine that ``update_weights`` pushes to."""
        raise NotImplementedError

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        """``xccl``: join the weight-update group (rank 0 only) while the servers join it."""
        raise NotImplementedError

    def get_param_specs(self, weight_chunked_mem_mb: int = 1024) -> list[list[ParamSpec]]:
        """Parameter specs grouped into broadcast buckets."""
        raise NotImplementedError

    def set_version(self, version: int) -> None:
        raise NotImplementedError

    def get_version(self) -> int:
        raise NotImplementedError

    def export_stats(self) -> dict[str, float]:
        """Stats gathered since the last export, reduced across data-parallel ranks."""
        return {}

    def offload(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Move weights/optimizer off the accelerator (no-op on CPU)."""

    def onload(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Undo ``offload`` (no-op on CPU)."""


class InferenceEngine(abc.ABC):
    """Generation side: talks to inference servers and runs rollout workflows."""

    @abc.abstractmethod
    def initialize(self, addr: str | list[str] | None = None, **kwargs) -> None: ...

    @abc.abstractmethod
    def destroy(self) -> None: ...

    def launch_server(self, server_args: dict[str, Any]) -> Any:
        """Start one inference server process and return its address info."""
        raise NotImplementedError

    def teardown_server(self) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request; survives pauses (interrupted requests are resumed)."""

    # --- weights ---------------------------------------------------------------------
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        raise NotImplementedError

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future:
        raise NotImplementedError

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> Future:
        raise NotImplementedError

    def pause_generation(self) -> None:
        """Interrupt in-flight generation on every server."""
        raise NotImplementedError

    def continue_generation(self) -> None:
        raise NotImplementedError

    def set_version(self, version: int) -> None:
        raise NotImplementedError

    def get_version(self) -> int:
        raise NotImplementedError

    # --- rollout (implemented on top of a WorkflowExecutor) --------------------------
    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> int:
        raise NotImplementedError

    def wait(self, count: int, timeout: float | None = None, **kwargs) -> dict[str, Any]:
        raise NotImplementedError

    def rollout_batch(
        self, data: list[dict[str, Any]], workflow=None, workflow_kwargs=None, **kwargs
    ):
        raise NotImplementedError

    def prepare_batch(self, dataloader, workflow=None, workflow_kwargs=None, **kwargs):
        raise NotImplementedError

    def pause(self) -> None:
        """Stop submitting new rollouts (in-flight ones continue)."""
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError
