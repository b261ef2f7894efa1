"""Data contracts exchanged between the trainer, the rollout side and inference servers.

Nothing here does work; these are the shapes every component agrees on.

Weight-update wire contract (``WeightUpdateMeta``)
--------------------------------------------------
``disk``: training rank 0 writes a Hugging Face directory (``save_pretrained``-compatible
safetensors + ``config.json``) to ``meta.path`` (``with_version(v)`` makes it
``{path}/v{v}``) and then the inference engine asks every server to reload from it.

``xccl``: one extra ``torch.distributed`` process group (gloo on CPU, NCCL on GPU) made of
training rank 0 (group rank 0, the broadcast root) and every inference server worker
(group ranks 1..n). ``init_weights_update_group(meta)`` makes the servers join it
(``master_address``/``master_port``/``group_name``/``world_size``) *while* training rank 0
joins it (the join is a rendezvous: neither side returns before the other has joined).
For each bucket of at most ``weight_chunked_mem_mb`` MiB, the trainer first announces the
bucket's ``ParamSpec`` list (name, shape, dtype) to every server over HTTP; the servers then
post a ``broadcast(tensor, src=0)`` per tensor in announcement order and the trainer sends
them. After the last bucket the servers swap the weights in and take ``meta.version``.
``timeout_s`` bounds the join and every single broadcast on both sides, so a failure on
one side surfaces on the other within that time instead of hanging.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from areal.api.cli_args import GenerationHyperparameters


@dataclass
class ModelRequest:
    """One generation request: token ids in, token ids out."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    tokenizer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # Vision-language models: one entry per image of the prompt, in order (base64 PNG/JPEG,
    # a data URL, or a path the server can read); ``input_ids`` holds each image's expanded
    # pad tokens as the model's processor writes them (see areal.workflow.vision_rlvr).
    image_data: list[Any] | None = None
    # Chat messages of the prompt with ``image_url`` parts (AReaL's name); needed only by
    # backends that take images through chat completions (vLLM).
    vision_msg_vllm: list[Any] | None = None
    # The processor that rendered the prompt (AReaL compatibility; not sent anywhere).
    processor: Any = None

    def copy(self) -> ModelRequest:
        return replace(self, input_ids=list(self.input_ids), metadata=dict(self.metadata))


StopReason = Literal["length", "stop", "abort", "interrupt"]


@dataclass
class ModelResponse:
    """Result of one request. ``output_versions[i]`` is the weight version that produced token i."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")  # time to first token, seconds
    tokenizer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # MoE, with rollout.return_routed_experts: the experts each token was routed to,
    # [input_len + output_len - 1, n_moe_layers, top_k] int32 (row i: the forward at
    # position i, which produced token i + 1); None otherwise
    routed_experts: Any = None

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class FinetuneSpec:
    """How long training lasts; used for LR schedules."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int
    total_train_steps_override: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        if self.total_train_steps_override is not None:
            return self.total_train_steps_override
        return self.total_train_epochs * self.steps_per_epoch


@dataclass
class StepInfo:
    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int

    def next(self) -> StepInfo:
        last = self.epoch_step == self.steps_per_epoch - 1
        return StepInfo(
            epoch=self.epoch + int(last),
            epoch_step=0 if last else self.epoch_step + 1,
            global_step=self.global_step + 1,
            steps_per_epoch=self.steps_per_epoch,
        )


@dataclass
class SaveLoadMeta:
    """Where and how a train engine saves or loads.

    ``weight_format``: ``hf`` (safetensors + config, gathered on rank 0; for export and
    weight updates) or ``dcp`` (sharded torch.distributed.checkpoint; exact resume).
    ``save_mode`` (``dcp`` saves): ``sync`` writes before ``save`` returns; ``async``
    stages the state to CPU memory and writes it on a background thread (``save`` returns
    ``True``: the write is pending until the engine's ``wait_async_save()``); ``auto`` is
    ``async`` when the engine supports it and the state is large enough to gain from it.
    """

    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer: Any = None
    base_model_path: str | None = None
    save_mode: Literal["sync", "async", "auto"] = "sync"

    def __post_init__(self):
        if self.weight_format not in ("hf", "dcp"):
            raise ValueError(
                f"SaveLoadMeta.weight_format={self.weight_format!r}; allowed: 'hf', 'dcp'"
            )
        if self.save_mode not in ("sync", "async", "auto"):
            raise ValueError(
                f"SaveLoadMeta.save_mode={self.save_mode!r}; allowed: 'sync', 'async', 'auto'"
            )


@dataclass
class ParamSpec:
    """Name, shape and dtype of one tensor announced before a broadcast."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", "bfloat16" (torch dtype name without "torch.")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def size_bytes(self) -> int:
        import torch

        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamSpec:
        return cls(name=d["name"], shape=tuple(int(x) for x in d["shape"]), dtype=d["dtype"])


@dataclass
class WeightUpdateMeta:
    """How the trainer pushes new weights to the inference servers (see module docstring)."""

    type: Literal["disk", "xccl"]
    path: str | None = None
    alloc_mode: Any = None
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "areal_weight_update"
    world_size: int = 0  # 1 (trainer rank 0) + number of inference workers; 0 = decide at init
    backend: str | None = None  # "gloo" | "nccl"; None = nccl when CUDA is available
    weight_chunked_mem_mb: int = 1024
    version: int | None = None
    timeout_s: float = 120.0  # xccl: bound of the group join and of each broadcast (both sides)
    # LoRA: send only the adapter (disk: adapter_model.safetensors + adapter_config.json),
    # registered on the servers as ``lora_name`` (areal.engine.lora.LoRASyncHook sets both)
    use_lora: bool = False
    lora_name: str | None = None
    # disk: every training rank writes its own share of the tensors
    # (``WeightExporter.export_weight_shards``; areal.infra.weights.transports)
    sharded: bool = False
    # disk: send only the elements changed since the servers' committed version, in
    # ``delta_dtype`` (the servers' model dtype), with a full sync first, every
    # ``delta_anchor_interval`` committed deltas (0: never periodically) and wherever the
    # servers have no delta route (``areal.infra.weights.transports.DeltaTransport``)
    delta: bool = False
    delta_dtype: str = "bfloat16"
    delta_anchor_interval: int = 0

    def __post_init__(self):
        if self.type not in ("disk", "xccl"):
            raise ValueError(f"WeightUpdateMeta.type={self.type!r}; allowed: 'disk', 'xccl'")
        if self.delta and (self.type != "disk" or self.use_lora or self.sharded):
            raise ValueError(
                f"WeightUpdateMeta.delta=True with type={self.type!r}, use_lora={self.use_lora}, "
                f"sharded={self.sharded}; delta needs type='disk' without use_lora / sharded"
            )
        if self.delta_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"WeightUpdateMeta.delta_dtype={self.delta_dtype!r}; allowed: 'float32', "
                "'bfloat16', 'float16'"
            )
        if not isinstance(self.delta_anchor_interval, int) or self.delta_anchor_interval < 0:
            raise ValueError(
                f"WeightUpdateMeta.delta_anchor_interval={self.delta_anchor_interval!r}; must "
                "be an integer >= 0"
            )
        if self.type == "disk" and not self.path:
            raise ValueError("WeightUpdateMeta.path is required when type='disk'")
        if self.weight_chunked_mem_mb <= 0:
            raise ValueError(
                f"WeightUpdateMeta.weight_chunked_mem_mb={self.weight_chunked_mem_mb}; must be > 0"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"WeightUpdateMeta.timeout_s={self.timeout_s}; must be > 0")

    def with_version(self, version: int) -> WeightUpdateMeta:
        """Copy for one update; for ``disk`` the path gets a ``v{version}`` sub-directory."""
        path = self.path
        if self.type == "disk" and self.version is None:
            path = os.path.join(self.path, f"v{version}")
        elif self.type == "disk":
            path = os.path.join(os.path.dirname(self.path), f"v{version}")
        return replace(self, path=path, version=version)

    @classmethod
    def from_disk(
        cls,
        experiment_name: str,
        trial_name: str,
        file_root: str,
        name: str = "default",
        alloc_mode: Any = None,
    ) -> WeightUpdateMeta:
        path = os.path.join(
            file_root, "checkpoints", experiment_name, trial_name, "weight_update", name
        )
        return cls(type="disk", path=path, alloc_mode=alloc_mode)

    @classmethod
    def from_fsdp_xccl(
        cls,
        allocation_mode: Any = None,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "areal_weight_update",
        weight_chunked_mem_mb: int = 1024,
        backend: str | None = None,
        timeout_s: float = 120.0,
    ) -> WeightUpdateMeta:
        return cls(
            type="xccl",
            alloc_mode=allocation_mode,
            master_address=master_address,
            master_port=master_port,
            group_name=group_name,
            weight_chunked_mem_mb=weight_chunked_mem_mb,
            backend=backend,
            timeout_s=timeout_s,
        )
