"""Configuration dataclasses and the YAML/command-line loader.

Every configurable part of the system is a dataclass here. Section and field names,
nesting, types and defaults follow AReaL's configuration reference, so that a YAML
written for AReaL loads unchanged; sections this project does not act on yet are
accepted and say so in their help text. Field order inside a class is
required -> common -> rare. ``docs/cli_reference.md`` is generated from these classes
(``python docs/generate_cli_docs.py``).

Loading::

    config, config_file = load_expr_config(sys.argv[1:], GRPOConfig)

reads ``--config file.yaml``, applies ``a.b=value`` / ``+a.b=value`` overrides, resolves
``${...}`` interpolations, validates (unknown keys, types, ``__post_init__`` checks) and
writes the resolved configuration to ``get_log_path(config)/config.yaml``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import types
import typing
from dataclasses import MISSING as _DC_MISSING
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from areal.utils import logging

logger = logging.getLogger("CLIArgs")

ConfigT = TypeVar("ConfigT")

_NOT_ACTED = "This project accepts this section so AReaL YAMLs load, but does not act on it yet."


def _field(
    default: Any = _DC_MISSING, help: str = "", choices: list | None = None, factory: Any = None
) -> Any:
    """``dataclasses.field`` with help text (and optional allowed values) in its metadata."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning(message)


def _is_missing(value: Any) -> bool:
    return isinstance(value, str) and value == MISSING


def _check_choice(owner: str, name: str, value: Any, allowed: list | tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed; choose one of {list(allowed)}")


def _check_range(
    owner: str,
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    optional: bool = False,
) -> None:
    """Raise ValueError naming ``owner.name`` when ``value`` is outside the given bounds."""
    if value is None:
        if optional:
            return
        raise ValueError(f"{owner}.{name}=None is not allowed; a number is required")
    bounds = []
    ok = True
    if gt is not None:
        bounds.append(f"> {gt}")
        ok &= value > gt
    if ge is not None:
        bounds.append(f">= {ge}")
        ok &= value >= ge
    if lt is not None:
        bounds.append(f"< {lt}")
        ok &= value < lt
    if le is not None:
        bounds.append(f"<= {le}")
        ok &= value <= le
    if not ok:
        extra = " (or None)" if optional else ""
        raise ValueError(
            f"{owner}.{name}={value!r} is not allowed; must be {' and '.join(bounds)}{extra}"
        )


# =====================================================================================
# Normalisation and micro-batching
# =====================================================================================

_NORM_LEVELS = ["batch", "group", None]
PACKING_ALGORITHMS = ["ffd", "kk"]


@dataclass
class NormConfig:
    """Reward or advantage normalisation: subtract a mean, divide by a standard deviation."""

    mean_level: str | None = _field(
        "batch",
        "Over which samples the mean is taken: 'batch' (whole batch), 'group' (the samples "
        "of one prompt), or None / 'none' (no mean subtraction).",
        choices=_NORM_LEVELS,
    )
    mean_leave1out: bool = _field(
        False, "Leave-one-out mean: each sample's baseline excludes the sample itself (RLOO)."
    )
    std_level: str | None = _field(
        "batch",
        "Over which samples the standard deviation is taken: 'batch', 'group', or "
        "None / 'none' (no division).",
        choices=_NORM_LEVELS,
    )
    std_unbiased: bool = _field(True, "Use the unbiased (n-1) standard deviation estimator.")
    eps: float = _field(1e-5, "Added to the standard deviation before dividing; > 0.")
    group_size: int = _field(
        1, "Samples per group for group-level statistics (usually gconfig.n_samples); >= 1."
    )

    def __post_init__(self):
        owner = "NormConfig"
        if isinstance(self.mean_level, str) and self.mean_level.lower() == "none":
            self.mean_level = None
        if isinstance(self.std_level, str) and self.std_level.lower() == "none":
            self.std_level = None
        _check_choice(owner, "mean_level", self.mean_level, ["batch", "group", "none", None])
        _check_choice(owner, "std_level", self.std_level, ["batch", "group", "none", None])
        _check_range(owner, "eps", self.eps, gt=0)
        _check_range(owner, "group_size", self.group_size, ge=1)


@dataclass
class MicroBatchSpec:
    """How one (mini-)batch is split into micro-batches for forward/backward passes.

    With ``max_tokens_per_mb`` set, sequences are packed into micro-batches of at most
    that many tokens (``packing_algorithm``: first-fit decreasing or Karmarkar-Karp),
    and ``n_mbs`` is the minimum number of micro-batches.
    """

    n_mbs: int | None = _field(
        1,
        "Number of micro-batches; the minimum number when max_tokens_per_mb is set; >= 1.",
    )
    granularity: int = _field(
        1,
        "Adjacent sequences are kept together in groups of this size when splitting "
        "(e.g. the samples of one prompt); >= 1.",
    )
    max_tokens_per_mb: int | None = _field(
        None,
        "Token budget of one micro-batch. None: split by n_mbs only.",
    )
    n_mbs_divisor: int = _field(
        1,
        "The number of micro-batches is rounded up to a multiple of this value "
        "(e.g. the pipeline-parallel size); >= 1.",
    )
    packing_algorithm: str = _field(
        "ffd",
        "How sequences are assigned to micro-batches (and to data-parallel ranks): 'ffd' "
        "(first-fit decreasing) or 'kk' (Karmarkar-Karp balanced partitioning: more even "
        "token counts, slightly slower).",
        choices=PACKING_ALGORITHMS,
    )

    def __post_init__(self):
        owner = "MicroBatchSpec"
        _check_choice(owner, "packing_algorithm", self.packing_algorithm, PACKING_ALGORITHMS)
        _check_range(owner, "n_mbs", self.n_mbs, ge=1, optional=True)
        _check_range(owner, "granularity", self.granularity, ge=1)
        _check_range(owner, "max_tokens_per_mb", self.max_tokens_per_mb, ge=1, optional=True)
        _check_range(owner, "n_mbs_divisor", self.n_mbs_divisor, ge=1)

    @classmethod
    def new(cls, mb_spec: MicroBatchSpec, **kwargs) -> MicroBatchSpec:
        """Copy of ``mb_spec`` with some fields changed."""
        args = {f.name: getattr(mb_spec, f.name) for f in fields(cls)}
        unknown = set(kwargs) - set(args)
        if unknown:
            raise ValueError(
                f"MicroBatchSpec has no field(s) {sorted(unknown)}; fields: {sorted(args)}"
            )
        args.update(kwargs)
        return cls(**args)


# =====================================================================================
# Generation
# =====================================================================================


@dataclass
class GenerationHyperparameters:
    """Sampling parameters for one generation request."""

    n_samples: int = _field(1, "Number of sequences sampled per prompt (the GRPO group size).")
    max_new_tokens: int = _field(16384, "Maximum number of generated tokens.")
    min_new_tokens: int = _field(0, "Minimum number of generated tokens before a stop is allowed.")
    max_tokens: int = _field(32768, "Maximum prompt + generated tokens.")
    greedy: bool = _field(False, "Greedy decoding (argmax) instead of sampling.")
    top_p: float = _field(1.0, "Nucleus sampling probability mass, in (0, 1].")
    top_k: int = _field(int(1e8), "Keep only the k most likely tokens when sampling.")
    temperature: float = _field(1.0, "Sampling temperature; > 0.")
    stop_token_ids: list[int] = _field(
        help="Token ids that end generation (EOS is always added by the engine).", factory=list
    )
    ignore_eos: bool = _field(False, "Keep generating after EOS.")
    skip_special_tokens: bool = _field(True, "Skip special tokens when decoding text.")
    stop: list[str] | None = _field(None, "Stop strings.")
    frequency_penalty: float = _field(
        0.0, "Frequency penalty (accepted; the built-in server ignores it)."
    )
    lora_name: str = _field(
        "default_lora", "Name of the LoRA adapter used for this request. " + _NOT_ACTED
    )
    use_beam_search: bool = _field(False, "Beam search (vLLM only). " + _NOT_ACTED)

    def __post_init__(self):
        if self.n_samples < 1:
            raise ValueError(f"gconfig.n_samples={self.n_samples}; must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"gconfig.max_new_tokens={self.max_new_tokens}; must be >= 1")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"gconfig.min_new_tokens={self.min_new_tokens}; must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if not self.temperature > 0:
            raise ValueError(f"gconfig.temperature={self.temperature}; must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"gconfig.top_p={self.top_p}; must be in (0, 1]")
        if self.top_k < 1:
            raise ValueError(f"gconfig.top_k={self.top_k}; must be >= 1")

    def new(self, **kwargs) -> GenerationHyperparameters:
        """Copy with some fields changed, e.g. ``gconfig.new(temperature=0.6)``."""
        d = asdict(self)
        unknown = set(kwargs) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"GenerationHyperparameters has no field(s) {sorted(unknown)}")
        d.update(kwargs)
        return GenerationHyperparameters(**d)

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationHyperparameters:
        """Copy whose ``stop_token_ids`` also hold the tokenizer's pad and EOS ids.

        Ids already present are not repeated; a tokenizer without a pad (or EOS) token
        (id ``None``) adds nothing for it.
        """
        stop_ids = list(self.stop_token_ids)
        for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if token_id is not None and token_id not in stop_ids:
                stop_ids.append(token_id)
        return self.new(stop_token_ids=stop_ids)

    def to_openai_args_dict(
        self, exclude_args: list[str] | None = None, api_format: str = "completions"
    ) -> dict[str, Any]:
        """Keyword arguments for an OpenAI-style client call.

        ``api_format``: 'completions' (``max_new_tokens`` -> ``max_completion_tokens``),
        'responses' (-> ``max_output_tokens``) or 'openai-agents' (-> ``max_tokens``);
        ``n_samples`` becomes ``n``. Fields OpenAI has no argument for
        (``OPENAI_UNSUPPORTED_GCONFIG_ARGS``) and those in ``exclude_args`` are left out,
        with a warning when they differ from their default.
        """
        renamed = {"n_samples": "n"}
        max_new_key = _OPENAI_MAX_NEW_TOKENS_KEY.get(api_format)
        if max_new_key is None:
            raise ValueError(
                f"api_format={api_format!r} is not allowed; choose one of "
                f"{list(_OPENAI_MAX_NEW_TOKENS_KEY)}"
            )
        renamed["max_new_tokens"] = max_new_key
        excluded = set(exclude_args or ()) | OPENAI_UNSUPPORTED_GCONFIG_ARGS
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in excluded:
                default = f.default if f.default is not _DC_MISSING else f.default_factory()
                if value != default:
                    logger.warning(
                        f"gconfig.{f.name}={value!r} has no OpenAI {api_format} argument; "
                        "it is not sent"
                    )
                continue
            key = renamed.get(f.name, f.name)
            if key in out:
                logger.warning(f"OpenAI argument {key!r} from gconfig.{f.name} overrides another")
            out[key] = list(value) if isinstance(value, list) else value
        return out

    def to_openai_completions_args_dict(
        self, exclude_args: list[str] | None = None
    ) -> dict[str, Any]:
        """``to_openai_args_dict(exclude_args, api_format='completions')``."""
        return self.to_openai_args_dict(exclude_args=exclude_args, api_format="completions")

    def to_openai_responses_args_dict(
        self, exclude_args: list[str] | None = None
    ) -> dict[str, Any]:
        """``to_openai_args_dict(exclude_args, api_format='responses')``."""
        return self.to_openai_args_dict(exclude_args=exclude_args, api_format="responses")

    def to_openai_agents_model_settings_dict(
        self, exclude_args: list[str] | None = None
    ) -> dict[str, Any]:
        """``to_openai_args_dict(exclude_args, api_format='openai-agents')``."""
        return self.to_openai_args_dict(exclude_args=exclude_args, api_format="openai-agents")


# Generation fields with no OpenAI-API argument (left out by to_openai_args_dict).
OPENAI_UNSUPPORTED_GCONFIG_ARGS = frozenset(
    {
        "min_new_tokens",
        "greedy",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "lora_name",
        "use_beam_search",
        "max_tokens",
    }
)
_OPENAI_MAX_NEW_TOKENS_KEY = {
    "completions": "max_completion_tokens",
    "responses": "max_output_tokens",
    "openai-agents": "max_tokens",
}


# =====================================================================================
# Training engines
# =====================================================================================

_DTYPES = ["float32", "bfloat16", "float16"]
_ATTN_IMPLS = ["flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention"]


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule of a trained model."""

    type: str = _field(
        "adam",
        "Optimizer: 'adam' (AdamW), 'sgd', or 'adam_bf16' (AdamW with bf16 states; GPU only).",
        choices=["adam", "sgd", "adam_bf16"],
    )
    lr: float = _field(1e-3, "Peak learning rate; >= 0.")
    weight_decay: float = _field(0.01, "Decoupled weight decay; >= 0.")
    beta1: float = _field(0.9, "Adam beta1 (first-moment decay), in [0, 1).")
    beta2: float = _field(0.999, "Adam beta2 (second-moment decay), in [0, 1).")
    eps: float = _field(1e-8, "Adam epsilon; > 0.")
    min_lr_ratio: float = _field(
        0.0, "Final learning rate as a fraction of lr for the linear/cosine schedules, in [0, 1]."
    )
    lr_scheduler_type: str = _field(
        "constant",
        "Learning-rate schedule after warm-up: 'constant', 'linear' or 'cosine' decay.",
        choices=["constant", "linear", "cosine"],
    )
    warmup_steps_proportion: float = _field(
        0.001, "Fraction of all training steps spent in linear warm-up, in [0, 1]."
    )
    gradient_clipping: float = _field(1.0, "Clip the global gradient norm to this value; > 0.")
    offload: bool = _field(False, "Keep optimizer states in CPU memory (GPU runs only).")
    initial_loss_scale: float = _field(2**32, "Initial fp16 loss scale. " + _NOT_ACTED)
    min_loss_scale: float = _field(1.0, "Minimum fp16 loss scale. " + _NOT_ACTED)
    loss_scale_window: float = _field(5, "Steps between fp16 loss-scale increases. " + _NOT_ACTED)
    hysteresis: int = _field(2, "fp16 loss-scale hysteresis. " + _NOT_ACTED)

    def __post_init__(self):
        owner = "OptimizerConfig"
        _check_choice(owner, "type", self.type, ["adam", "sgd", "adam_bf16"])
        _check_choice(
            owner, "lr_scheduler_type", self.lr_scheduler_type, ["constant", "linear", "cosine"]
        )
        _check_range(owner, "lr", self.lr, ge=0)
        _check_range(owner, "weight_decay", self.weight_decay, ge=0)
        _check_range(owner, "beta1", self.beta1, ge=0, lt=1)
        _check_range(owner, "beta2", self.beta2, ge=0, lt=1)
        _check_range(owner, "eps", self.eps, gt=0)
        _check_range(owner, "min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        _check_range(owner, "warmup_steps_proportion", self.warmup_steps_proportion, ge=0, le=1)
        _check_range(owner, "gradient_clipping", self.gradient_clipping, gt=0)


@dataclass
class FSDPWrapPolicy:
    """Which modules FSDP shards as separate units."""

    transformer_layer_cls_to_wrap: list[str] | None = _field(
        None,
        "Class names of the layers to shard separately. None: the model's decoder layers "
        "(transformers' _no_split_modules).",
    )


@dataclass
class FSDPEngineConfig:
    """Options of the FSDP2 training backend."""

    wrap_policy: FSDPWrapPolicy | None = _field(
        None, "Sharding-unit policy; None uses the default."
    )
    offload_params: bool = _field(False, "Keep sharded parameters in CPU memory (GPU runs only).")
    memory_efficient_load: bool = _field(
        False, "Load pretrained weights on rank 0 only and broadcast after sharding. " + _NOT_ACTED
    )
    per_layer_optim_step: bool = _field(
        False, "Layer-by-layer optimizer step on GPU. " + _NOT_ACTED
    )
    optim_step_prefetch_layers: int = _field(
        1, "Layers prefetched by per_layer_optim_step. " + _NOT_ACTED
    )
    shard_vision_across_sp: bool = _field(
        False, "Shard a vision encoder across sequence-parallel ranks. " + _NOT_ACTED
    )


@dataclass
class FP8EngineConfig:
    """FP8 training options of the Megatron backend. This project accepts it so AReaL YAMLs load, but does not act on it (no Megatron / FP8 hardware)."""

    mode: str = _field("e4m3", "'e4m3' or 'hybrid' (e5m2 for output-activation gradients).")
    recipe: str = _field(
        "delayed", "Scaling recipe: 'tensorwise', 'delayed', 'mxfp8', 'blockwise'."
    )
    param: bool = _field(False, "Keep parameters in FP8.")
    margin: int = _field(0, "Margin of the scaling-factor computation.")
    amax_history_len: int = _field(1, "Length of the amax history window.")
    amax_compute_algo: str = _field("most_recent", "'max' or 'most_recent'.")
    wgrad: bool = _field(True, "FP8 weight gradients (False: higher precision).")
    dot_product_attention: bool = _field(False, "FP8 dot-product attention.")
    multi_head_attention: bool = _field(False, "FP8 multi-head attention.")
    tp_only_amax_red: bool = _field(False, "Reduce amax only in the TP (or TP-CP) domain.")
    first_last_layers_bf16: bool = _field(False, "Keep the first/last blocks in BF16.")
    num_layers_at_start_in_bf16: int = _field(1, "Leading blocks kept in BF16.")
    num_layers_at_end_in_bf16: int = _field(1, "Trailing blocks kept in BF16.")
    direct_convert: bool = _field(True, "Convert FP8 parameters directly on weight update/save.")


@dataclass
class ArchonFP8Config:
    """FP8 options of the Archon backend. This project accepts it so AReaL YAMLs load, but does not act on it (no Archon / FP8 hardware)."""

    mode: str = _field(
        "disabled",
        "'disabled' or 'blockwise' (128x128 FP8 matmuls, Hopper GPUs).",
        choices=["disabled", "blockwise"],
    )
    exclude_modules: list[str] = _field(
        help="Name substrings of linear layers kept in BF16.",
        factory=lambda: ["output", "router", "score"],
    )
    include_experts: bool = _field(False, "FP8 for MoE experts too.")
    use_triton: bool = _field(True, "Triton GEMM kernels for blockwise FP8.")

    def __post_init__(self):
        _check_choice("ArchonFP8Config", "mode", self.mode, ["disabled", "blockwise"])


@dataclass
class ArchonEngineConfig:
    """Archon training backend options. This project accepts it so AReaL YAMLs load, but does not act on it (no Archon backend)."""

    attn_type: str = _field(
        "varlen", "'varlen', 'sdpa' or 'tree'.", choices=["varlen", "sdpa", "tree"]
    )
    offload_params: bool = _field(False, "Offload FSDP parameters to CPU.")
    enable_compile: bool = _field(False, "torch.compile the transformer blocks.")
    ac_mode: str = _field(
        "selective",
        "Activation checkpointing: 'none', 'full', 'selective', 'memory_budget'.",
        choices=["none", "full", "selective", "memory_budget"],
    )
    selective_ac_option: str = _field("op", "'op' or every N-th layer ('2').")
    ac_memory_budget: float = _field(0.5, "Memory budget of 'memory_budget' checkpointing.")
    ac_preserve_rng_state: bool = _field(False, "Preserve the RNG state in checkpointing.")
    ac_debug: bool = _field(False, "Capture checkpointing debug information.")
    pp_schedule: str = _field(
        "Interleaved1F1B",
        "Pipeline schedule.",
        choices=["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
    )
    pp_layers_per_stage: int | None = _field(None, "Layers per (virtual) pipeline stage.")
    pp_first_stage_less_layers: int = _field(1, "Fewer layers in the first stage.")
    pp_last_stage_less_layers: int = _field(1, "Fewer layers in the last stage.")
    reshard_after_forward_policy: str = _field(
        "default", "'default', 'always' or 'never'.", choices=["default", "always", "never"]
    )
    fp8_config: ArchonFP8Config = _field(help="FP8 training.", factory=ArchonFP8Config)
    use_deterministic_algorithms: bool = _field(False, "Deterministic kernels.")
    moe_router_dtype: str | None = _field(
        "fp32", "Dtype of the MoE router GEMM ('fp32' or None).", choices=["fp32", None]
    )


@dataclass
class DistributedDataParallelConfig:
    """Megatron DistributedDataParallel options. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    grad_reduce_in_fp32: bool = _field(True, "Reduce gradients in fp32.")
    overlap_grad_reduce: bool = _field(False, "Overlap gradient reduction with backward.")
    overlap_param_gather: bool = _field(False, "Overlap parameter all-gather with forward.")
    align_param_gather: bool = _field(False, "Align parameter all-gathers across pipeline stages.")
    use_distributed_optimizer: bool = _field(
        True, "Shard optimizer states across data-parallel ranks."
    )
    check_for_nan_in_grad: bool = _field(False, "Check gradients for NaN after reduction.")
    bucket_size: int | None = _field(
        None, "Gradient bucket size in elements; None for the default."
    )
    average_in_collective: bool = _field(False, "Average (not sum) inside the collective.")
    fp8_param_gather: bool = _field(False, "All-gather parameters in fp8.")


@dataclass
class MegatronEngineConfig:
    """Megatron-LM training backend options. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    wrap_with_ddp: bool = _field(True, "Wrap the model with Megatron DDP.")
    use_torch_fsdp2: bool = _field(False, "Use torch FSDP2 inside Megatron.")
    use_custom_fsdp: bool = _field(False, "Use Megatron's custom FSDP.")
    ddp: DistributedDataParallelConfig = _field(
        help="Megatron DDP options.", factory=DistributedDataParallelConfig
    )
    virtual_pipeline_parallel_size: int = _field(1, "Virtual pipeline stages per rank (1 = off).")
    overlap_param_gather_with_optimizer_step: bool = _field(
        False, "Overlap parameter gather with the optimizer step."
    )
    use_precision_aware_optimizer: bool = _field(False, "Precision-aware optimizer.")
    main_grads_dtype: str = _field("float32", "Dtype of main gradients.")
    main_params_dtype: str = _field("float32", "Dtype of main parameters.")
    exp_avg_dtype: str = _field("float32", "Dtype of Adam first moments.")
    exp_avg_sq_dtype: str = _field("float32", "Dtype of Adam second moments.")
    async_save: bool = _field(False, "Save checkpoints asynchronously.")
    use_checkpoint_opt_param_scheduler: bool = _field(
        True, "Restore the LR scheduler from the checkpoint."
    )
    use_deterministic_algorithms: bool = _field(False, "Force deterministic kernels.")
    recompute_granularity: str | None = _field("full", "Activation recomputation granularity.")
    recompute_method: str | None = _field("uniform", "Activation recomputation method.")
    recompute_num_layers: int | None = _field(1, "Layers per recomputation unit.")
    distribute_saved_activations: bool | None = _field(
        None, "Distribute saved activations over TP."
    )
    recompute_modules: list[str] | None = _field(None, "Modules to recompute.")
    moe_router_dtype: str | None = _field("fp32", "Dtype of the MoE router computation.")
    moe_shared_expert_overlap: bool = _field(False, "Overlap shared experts with dispatch.")
    moe_enable_deepep: bool = _field(False, "Use DeepEP for MoE dispatch.")
    moe_token_dispatcher_type: str = _field("alltoall", "MoE token dispatcher type.")
    moe_permute_fusion: bool = _field(False, "Fuse MoE token permutation.")
    fp8_config: FP8EngineConfig | None = _field(None, "FP8 training options.")
    bridge_type: str = _field("mbridge", "HF <-> Megatron bridge: 'mbridge' or 'megatron-bridge'.")
    use_mbridge_save: bool = _field(False, "Save weights with mbridge (less GPU memory).")


class SchedulingStrategyType(StrEnum):
    """Values of ``SchedulingStrategy.type``."""

    separation = "separation"
    colocation = "colocation"


@dataclass
class SchedulingStrategy:
    """Whether a role gets its own workers or shares another role's workers."""

    type: str = _field(
        "separation",
        "'separation': own workers; 'colocation': share the workers of `target`.",
        choices=["separation", "colocation"],
    )
    target: str | None = _field(
        None, "Role to colocate with (e.g. 'actor'); required for colocation."
    )
    fork: bool = _field(
        True,
        "With colocation, start a separate process on the target's devices instead of sharing it.",
    )

    def __post_init__(self):
        _check_choice("SchedulingStrategy", "type", self.type, ["separation", "colocation"])
        if self.type == "colocation" and not self.target:
            raise ValueError(
                "SchedulingStrategy.target is empty; 'colocation' needs the role to colocate with, e.g. 'actor'"
            )


@dataclass
class SchedulingSpec:
    """Resources and launch command of one kind of worker process."""

    cpu: int = _field(8, "CPU cores per worker; >= 0.")
    gpu: int = _field(0, "GPUs per worker; >= 0 (0 on CPU machines).")
    mem: int = _field(32, "Memory per worker in GB; >= 0.")
    port_count: int = _field(2, "Network ports reserved per worker; >= 0.")
    image: str = _field(
        "/storage/openpsi/images/areal-latest.sif",
        "Container image (Slurm with apptainer only).",
    )
    task_type: str = _field(
        "worker", "'worker' (RPC worker process) or 'engine'.", choices=["worker", "engine"]
    )
    env_vars: dict[str, str] = _field(
        help="Extra environment variables of the worker.", factory=dict
    )
    cmd: str | None = _field(
        None, "Command that starts the worker; None for the project's RPC worker."
    )
    srun_additional_args: str = _field(
        "--unbuffered --mpi=pmi2 -K --chdir $PWD", "Extra `srun` arguments (Slurm only)."
    )
    additional_bash_cmds: list[str] | None = _field(
        None, "Shell commands run before the worker starts (Slurm only)."
    )
    container_type: str = _field(
        "apptainer",
        "Container runtime on Slurm: 'apptainer' or 'none'.",
        choices=["apptainer", "none"],
    )
    mount: str = _field("/storage:/storage", "Bind mount for the container (Slurm only).")
    nodelist: str | None = _field(None, "`--nodelist` for sbatch/srun (Slurm only).")
    exclude: str | None = _field(None, "`--exclude` for sbatch/srun (Slurm only).")
    ray_placement_strategy: str = _field(
        "shared",
        "Ray placement groups: 'shared' (one for the role), 'separate' (one per worker), "
        "'deferred' (like separate, accelerators assigned later).",
        choices=["shared", "separate", "deferred"],
    )

    def __post_init__(self):
        owner = "SchedulingSpec"
        for name in ("cpu", "gpu", "mem", "port_count"):
            _check_range(owner, name, getattr(self, name), ge=0)
        _check_choice(owner, "task_type", self.task_type, ["worker", "engine"])
        _check_choice(owner, "container_type", self.container_type, ["apptainer", "none"])
        _check_choice(
            owner,
            "ray_placement_strategy",
            self.ray_placement_strategy,
            ["shared", "separate", "deferred"],
        )


def _default_scheduling_spec() -> list[SchedulingSpec]:
    return [SchedulingSpec(cpu=1, mem=4)]


@dataclass
class TrainEngineConfig:
    """A trained (or forward-only) model: where it comes from, precision, optimizer, backend."""

    experiment_name: str = _field(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = _field(MISSING, "Trial name; defaults to the top-level trial_name.")
    path: str = _field(
        "",
        "HuggingFace checkpoint directory or hub name of the model (config + weights; only "
        "the config when init_from_scratch).",
    )
    init_from_scratch: bool = _field(
        False, "Randomly initialise the weights instead of loading them."
    )
    dtype: str = _field(
        "bfloat16", "Parameter dtype: 'float32', 'bfloat16' or 'float16'.", choices=_DTYPES
    )
    optimizer: OptimizerConfig | None = _field(
        None, "Optimizer; None means the model is not trained (e.g. the reference model)."
    )
    mb_spec: MicroBatchSpec = _field(
        help="Micro-batch split of each forward/backward pass.", factory=MicroBatchSpec
    )
    backend: str = _field(
        "",
        "Training backend and parallel sizes, e.g. 'fsdp:d2'. Empty: taken from the "
        "top-level allocation_mode.",
    )
    attn_impl: str = _field(
        "flash_attention_2",
        "transformers attention implementation. On CPU the engines use 'sdpa' instead of "
        "flash attention.",
        choices=_ATTN_IMPLS,
    )
    gradient_checkpointing: bool = _field(
        False, "Recompute activations in backward to save memory."
    )
    disable_dropout: bool = _field(False, "Set every dropout probability to 0.")
    temperature: float = _field(
        1.0, "Sampling temperature the logits are divided by when computing logprobs; > 0."
    )
    weight_update_mode: str = _field(
        "xccl",
        "How new weights reach the inference servers: 'xccl' (collective broadcast: NCCL "
        "on GPU, gloo on CPU) or 'disk' (safetensors + reload).",
        choices=["disk", "xccl"],
    )
    weight_update_timeout: float = _field(
        120.0,
        "xccl only (this project's addition): seconds that the weight-update group join and "
        "each broadcast may wait for the other side (trainer and inference servers) before "
        "failing with an error; > 0.",
    )
    num_threads: int = _field(
        1,
        "CPU only (this project's addition): torch intra-op threads per training worker; >= 1. "
        "One thread per process is fastest when processes share few cores.",
    )
    is_critic: bool = _field(False, "The model has a scalar value head (critic or reward model).")
    pad_to_maximum: bool = _field(
        False, "Pad every micro-batch to max_tokens_per_mb (steadier memory, slower)."
    )
    grad_reduce_dtype: str = _field("float32", "Dtype of gradient reduction.", choices=_DTYPES)
    scheduling_spec: list[SchedulingSpec] = _field(
        help="Worker resources: one spec (engine inside the worker) or two (worker, engine). "
        "Used by the single-controller schedulers.",
        factory=_default_scheduling_spec,
    )
    scheduling_strategy: SchedulingStrategy = _field(
        help="Own workers ('separation') or another role's ('colocation').",
        factory=SchedulingStrategy,
    )
    fsdp: FSDPEngineConfig = _field(help="FSDP2 backend options.", factory=FSDPEngineConfig)
    megatron: MegatronEngineConfig = _field(
        help="Megatron backend options. " + _NOT_ACTED, factory=MegatronEngineConfig
    )
    archon: ArchonEngineConfig = _field(
        help="Archon backend options. " + _NOT_ACTED, factory=ArchonEngineConfig
    )
    offload: bool = _field(
        False, "Offload parameters and optimizer states to CPU between uses (GPU). " + _NOT_ACTED
    )
    use_kernels: bool = _field(False, "Apply HuggingFace `kernels` to the model. " + _NOT_ACTED)
    use_lora: bool = _field(False, "Train LoRA adapters. " + _NOT_ACTED)
    lora_rank: int = _field(32, "LoRA rank. " + _NOT_ACTED)
    lora_alpha: int = _field(16, "LoRA alpha. " + _NOT_ACTED)
    target_modules: list[str] = _field(help="LoRA target modules. " + _NOT_ACTED, factory=list)
    peft_type: str = _field("lora", "PEFT method. " + _NOT_ACTED)
    enable_tree_training: bool = _field(False, "Tree training with flex attention. " + _NOT_ACTED)
    _version: str = _field(
        "v1",
        "AReaL's train-controller version: 'v1' (this project's controller) or 'v2' (AReaL's "
        "gateway controller). " + _NOT_ACTED,
        choices=["v1", "v2"],
    )
    admin_api_key: str = _field("areal-admin-key", "Gateway admin key (v2). " + _NOT_ACTED)
    log_level: str = _field("warning", "Gateway log level (v2). " + _NOT_ACTED)
    request_timeout: float = _field(
        3600.0, "Gateway request timeout in seconds (v2). " + _NOT_ACTED
    )
    setup_timeout: float = _field(3600.0, "Gateway setup timeout in seconds (v2). " + _NOT_ACTED)

    def __post_init__(self):
        owner = type(self).__name__
        _check_choice(owner, "dtype", self.dtype, _DTYPES)
        _check_choice(owner, "grad_reduce_dtype", self.grad_reduce_dtype, _DTYPES)
        if self.attn_impl not in _ATTN_IMPLS and "/" not in self.attn_impl:
            raise ValueError(
                f"{owner}.attn_impl={self.attn_impl!r} is not allowed; choose one of {_ATTN_IMPLS} "
                "or a kernels repo id 'org/repo'"
            )
        _check_choice(owner, "weight_update_mode", self.weight_update_mode, ["disk", "xccl"])
        _check_range(owner, "weight_update_timeout", self.weight_update_timeout, gt=0)
        _check_range(owner, "num_threads", self.num_threads, ge=1)
        _check_range(owner, "temperature", self.temperature, gt=0)
        if len(self.scheduling_spec) not in (1, 2):
            raise ValueError(
                f"{owner}.scheduling_spec has {len(self.scheduling_spec)} entries; must have 1 or 2"
            )
        if self.backend:
            from areal.api.alloc_mode import ParallelStrategy

            ParallelStrategy.parse_backend(self.backend, field_name=f"{owner}.backend")


_PROX_LOGP_METHODS = ["recompute", "loglinear", "metrics"]
_BEHAVE_IMP_WEIGHT_MODES = [
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "disabled",
]
_RS_LEVELS = ["token", "sequence"]
_RS_ACTIONS = ["mask", "clamp"]
_RS_METRICS = ["ratio", "kl_k1", "kl_k2", "kl_k3"]
_RS_AGGS = ["sum", "mean", "max"]


@dataclass
class RejectionSamplingConfig:
    """Filtering of stale samples in the decoupled loss, by how far the proximal policy
    has moved from the behaviour policy that generated them.

    With r = pi_prox / pi_behave per token, the metric is r itself ('ratio') or a KL
    estimate: k1 = log r, k2 = (log r)^2 / 2, k3 = r - log r - 1. At 'sequence' level the
    per-token values of a sequence are aggregated ('sum' / 'mean' of log r for 'ratio',
    i.e. a product / geometric mean; arithmetic for KL; or 'max') and the whole sequence
    shares one decision. 'mask' removes tokens (sequences) outside [lower, upper] from
    the loss; 'clamp' (ratio only) clamps the importance weight into [lower, upper].
    Replaces the legacy ``behave_imp_weight_cap`` / ``behave_imp_weight_mode``.
    """

    level: str = _field(
        "token",
        "'token': each token judged on its own; 'sequence': one decision per sequence "
        "(with metric 'ratio' the correction weight is the sequence's aggregated ratio too).",
        choices=_RS_LEVELS,
    )
    action: str = _field(
        "mask",
        "'mask': drop tokens/sequences outside the bounds from the loss; 'clamp': clamp "
        "the importance weight into [lower, upper] (metric 'ratio' only).",
        choices=_RS_ACTIONS,
    )
    metric: str = _field(
        "ratio",
        "'ratio' (pi_prox / pi_behave), 'kl_k1' (log r, may be negative), 'kl_k2' "
        "((log r)^2 / 2), 'kl_k3' (r - log r - 1).",
        choices=_RS_METRICS,
    )
    agg: str = _field(
        "mean",
        "Sequence-level aggregation: 'sum', 'mean' (in log space for 'ratio': product / "
        "geometric mean) or 'max'. Ignored at level 'token'.",
        choices=_RS_AGGS,
    )
    upper: float = _field(
        5.0,
        "Upper bound: values above it are filtered (or clamped). > 1 for 'ratio', > 0 for "
        "'kl_k2' / 'kl_k3'.",
    )
    lower: float | None = _field(
        None,
        "Lower bound; None: none ('clamp' sets it to 0.0). > 0 for 'ratio' (0.0 allowed "
        "with 'clamp'); <= upper.",
    )

    def __post_init__(self):
        owner = "RejectionSamplingConfig"
        _check_choice(owner, "level", self.level, _RS_LEVELS)
        _check_choice(owner, "action", self.action, _RS_ACTIONS)
        _check_choice(owner, "metric", self.metric, _RS_METRICS)
        _check_choice(owner, "agg", self.agg, _RS_AGGS)
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(
                f"{owner}.lower={self.lower!r} is not allowed; must be <= upper={self.upper!r}"
            )
        if self.metric == "ratio":
            if self.upper <= 1.0:
                raise ValueError(
                    f"{owner}.upper={self.upper!r} is not allowed with metric='ratio'; must be "
                    "> 1 (otherwise every token whose policy changed at all is filtered)"
                )
            # 0.0 is what 'clamp' fills in for "no lower bound"; a saved config holds it.
            floor_ok = self.action == "clamp" and self.lower == 0.0
            if self.lower is not None and self.lower <= 0 and not floor_ok:
                raise ValueError(
                    f"{owner}.lower={self.lower!r} is not allowed with metric='ratio'; must be "
                    "> 0 (or 0.0 with action='clamp')"
                )
        if self.metric in ("kl_k2", "kl_k3") and self.upper <= 0:
            raise ValueError(
                f"{owner}.upper={self.upper!r} is not allowed with metric={self.metric!r}; "
                "must be > 0"
            )
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"{owner}.action='clamp' is not allowed with metric={self.metric!r}; clamping "
                "applies to the importance ratio only (metric='ratio'); use action='mask'"
            )
        if self.action == "clamp" and self.lower is None:
            self.lower = 0.0
        if self.level == "token" and self.agg != "mean":
            _warn_once(
                f"rs-agg-{self.agg}",
                f"{owner}.agg={self.agg!r} is ignored with level='token' (aggregation "
                "applies to level='sequence' only)",
            )


def legacy_rejection_sampling(
    cap: float | None, mode: str | None
) -> RejectionSamplingConfig | None:
    """The ``rejection_sampling`` equivalent of legacy ``behave_imp_weight_cap`` / ``_mode``.

    'token_mask' / 'token_truncate' / 'sequence_mask' / 'sequence_truncate' with cap X ->
    ``{level: token|sequence, action: mask|clamp, metric: ratio, upper: X}``; 'disabled'
    or no cap -> None (no filtering). ``mode=None`` means 'token_mask'.
    """
    mode = mode or "token_mask"
    _check_choice("PPOActorConfig", "behave_imp_weight_mode", mode, _BEHAVE_IMP_WEIGHT_MODES)
    if mode == "disabled" or cap is None:
        return None
    level, how = mode.split("_", 1)
    return RejectionSamplingConfig(
        level=level, action="mask" if how == "mask" else "clamp", metric="ratio", upper=cap
    )


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy model of PPO/GRPO and its loss: clipping, rewards, advantages, KL, async corrections."""

    # ---- core PPO / GRPO
    group_size: int = _field(
        1,
        "Samples per prompt in a batch (usually gconfig.n_samples); used by group statistics; >= 1.",
    )
    ppo_n_minibatches: int = _field(
        4,
        "Each training batch is split into this many mini-batches, one optimizer step each; >= 1.",
    )
    eps_clip: float = _field(
        0.2,
        "PPO clip range of the probability ratio (lower side when eps_clip_higher is set); >= 0.",
    )
    eps_clip_higher: float | None = _field(
        None, "Upper clip range (DAPO clip-higher); None uses eps_clip on both sides; >= 0."
    )
    c_clip: float | None = _field(
        None, "Dual-clip bound for negative advantages; > 1. None disables dual clipping."
    )
    # ---- rewards
    reward_scaling: float = _field(
        1.0, "Rewards are multiplied by this factor (after adding reward_bias)."
    )
    reward_bias: float = _field(0.0, "Added to every reward before scaling.")
    reward_clip: float = _field(20.0, "Rewards are clipped to [-reward_clip, reward_clip]; > 0.")
    reward_norm: NormConfig | None = _field(
        None, "Reward normalisation (e.g. per group for GRPO); None: off."
    )
    overlong_reward_penalty: bool = _field(
        False, "DAPO soft overlong penalty on responses close to max_new_tokens."
    )
    overlong_tokens: int | None = _field(
        None,
        "Length of the penalised tail before max_new_tokens; required with overlong_reward_penalty.",
    )
    overlong_penalty_factor: float | None = _field(
        None, "Maximum penalty of the overlong tail; required with overlong_reward_penalty."
    )
    mask_no_eos_with_zero: bool = _field(
        False, "Exclude truncated responses (no EOS) from the loss."
    )
    # ---- advantages
    discount: float = _field(1.0, "Discount factor gamma of future rewards, in [0, 1].")
    gae_lambda: float = _field(1.0, "GAE lambda, in [0, 1].")
    adv_norm: NormConfig | None = _field(None, "Advantage normalisation; None: off.")
    # ---- KL
    kl_ctl: float = _field(
        0.1, "Coefficient of the KL penalty against the reference model; >= 0 (0 = no KL)."
    )
    kl_estimator: str = _field(
        "k1",
        "KL estimator: 'k1' (log-ratio), 'k2' (squared log-ratio / 2), 'k3' (Schulman's unbiased).",
        choices=["k1", "k2", "k3"],
    )
    # ---- asynchronous RL
    recompute_logprob: bool = _field(
        False, "Recompute token logprobs with the training engine before the update."
    )
    use_decoupled_loss: bool = _field(
        False,
        "Decoupled PPO objective (AReaL): clip against the proximal policy and weight by "
        "the behaviour importance ratio. Implies recompute_logprob=True.",
    )
    rejection_sampling: RejectionSamplingConfig | None = _field(
        None,
        "Filtering of stale samples by the proximal/behaviour divergence (decoupled loss "
        "only); None: no filtering.",
    )
    behav_imp_weight_cap: float | None = _field(
        None,
        "DEPRECATED (use rejection_sampling): cap of the behaviour importance weight; > 1. "
        "Migrated into rejection_sampling with a warning.",
    )
    behave_imp_weight_cap: float | None = _field(
        None,
        "DEPRECATED (use rejection_sampling): later spelling of behav_imp_weight_cap; takes "
        "precedence over it.",
    )
    behave_imp_weight_mode: str = _field(
        "token_mask",
        "DEPRECATED (use rejection_sampling): 'token_mask', 'token_truncate', "
        "'sequence_mask', 'sequence_truncate' or 'disabled'; with a cap X migrated to "
        "rejection_sampling {level, action: mask|clamp, metric: ratio, upper: X}.",
        choices=_BEHAVE_IMP_WEIGHT_MODES,
    )
    importance_sampling_level: str = _field(
        "token",
        "'token': per-token ratios (PPO); 'sequence': geometric mean of the ratios over a "
        "sequence (GSPO).",
        choices=["token", "sequence"],
    )
    prox_logp_method: str = _field(
        "recompute",
        "How the proximal logprobs of the decoupled loss are obtained: 'recompute' (forward "
        "pass), 'loglinear' (interpolated, no forward pass), 'metrics' (recompute and log "
        "the interpolation error).",
        choices=_PROX_LOGP_METHODS,
    )
    # ---- algorithm variants
    m2_threshold: float | None = _field(
        None,
        "M2PO: tokens are masked, largest squared log-ratio first, until the batch's second "
        "moment of the log-ratio is at most this threshold; > 0. None: M2PO off.",
    )
    use_sapo_loss: bool = _field(
        False,
        "SAPO: replace hard ratio clipping by a smooth sigmoid gate of the ratio. "
        "Incompatible with use_decoupled_loss.",
    )
    sapo_tau_pos: float = _field(1.0, "SAPO gate temperature for positive advantages; > 0.")
    sapo_tau_neg: float = _field(1.05, "SAPO gate temperature for negative advantages; > 0.")
    dynamic_sampling: bool = _field(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal (variable batch size).",
    )
    # ---- logging and others
    log_agent_stats: bool = _field(False, "Log extra per-trajectory statistics of agent workflows.")
    log_agent_stats_keys: list[str] = _field(
        help="Keys of the trajectory dict logged when log_agent_stats.", factory=list
    )
    max_new_tokens: int = _field(
        1024,
        "Generation length limit (usually ${gconfig.max_new_tokens}); used by overlong penalties.",
    )
    loss_agg_mode: str = _field(
        "token-mean",
        "How token losses are reduced: 'token-mean' (mean over all loss tokens), "
        "'seq-mean-token-mean' (token mean per sequence, then mean over sequences), "
        "'seq-mean-token-sum-norm' (token sum per sequence / loss_norm_constant, mean over "
        "sequences; Dr.GRPO).",
        choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    )
    loss_norm_constant: float | None = _field(
        None, "Constant divisor of 'seq-mean-token-sum-norm'; None: max_new_tokens; > 0."
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        _check_range(owner, "group_size", self.group_size, ge=1)
        _check_range(owner, "ppo_n_minibatches", self.ppo_n_minibatches, ge=1)
        _check_range(owner, "eps_clip", self.eps_clip, ge=0)
        _check_range(owner, "eps_clip_higher", self.eps_clip_higher, ge=0, optional=True)
        _check_range(owner, "c_clip", self.c_clip, gt=1, optional=True)
        _check_range(owner, "reward_clip", self.reward_clip, gt=0)
        _check_range(owner, "discount", self.discount, ge=0, le=1)
        _check_range(owner, "gae_lambda", self.gae_lambda, ge=0, le=1)
        _check_range(owner, "kl_ctl", self.kl_ctl, ge=0)
        _check_choice(owner, "kl_estimator", self.kl_estimator, ["k1", "k2", "k3"])
        _check_choice(
            owner,
            "importance_sampling_level",
            self.importance_sampling_level,
            ["token", "sequence"],
        )
        _check_choice(owner, "prox_logp_method", self.prox_logp_method, _PROX_LOGP_METHODS)
        _check_choice(
            owner, "behave_imp_weight_mode", self.behave_imp_weight_mode, _BEHAVE_IMP_WEIGHT_MODES
        )
        if self.behave_imp_weight_cap is not None:
            self.behav_imp_weight_cap = self.behave_imp_weight_cap
        _check_range(owner, "behav_imp_weight_cap", self.behav_imp_weight_cap, gt=1, optional=True)
        self._migrate_legacy_rejection_sampling()
        _check_range(owner, "m2_threshold", self.m2_threshold, gt=0, optional=True)
        _check_range(owner, "max_new_tokens", self.max_new_tokens, ge=1)
        _check_choice(
            owner,
            "loss_agg_mode",
            self.loss_agg_mode,
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
        )
        _check_range(owner, "loss_norm_constant", self.loss_norm_constant, gt=0, optional=True)
        if self.use_decoupled_loss:
            # As AReaL: the decoupled loss implies recompute_logprob.
            self.recompute_logprob = True
            if self.rejection_sampling is None:
                _warn_once(
                    "decoupled-no-rs",
                    f"{owner}.use_decoupled_loss=True with rejection_sampling=None: stale "
                    "samples are not filtered. The former default (cap 5.0, token_mask) is "
                    "rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0}",
                )
        elif self.rejection_sampling is not None:
            _warn_once(
                "rs-without-decoupled",
                f"{owner}.rejection_sampling is set but use_decoupled_loss=False; it is ignored",
            )
        if self.use_sapo_loss:
            _check_range(owner, "sapo_tau_pos", self.sapo_tau_pos, gt=0)
            _check_range(owner, "sapo_tau_neg", self.sapo_tau_neg, gt=0)
            if self.use_decoupled_loss:
                raise ValueError(
                    f"{owner}.use_sapo_loss=True is incompatible with {owner}.use_decoupled_loss=True; "
                    "set one of them to false"
                )
        if self.overlong_reward_penalty:
            if self.overlong_tokens is None or self.overlong_penalty_factor is None:
                raise ValueError(
                    f"{owner}.overlong_reward_penalty=True requires overlong_tokens and "
                    f"overlong_penalty_factor (got {self.overlong_tokens!r}, {self.overlong_penalty_factor!r})"
                )
            _check_range(owner, "overlong_tokens", self.overlong_tokens, ge=1)
            _check_range(owner, "overlong_penalty_factor", self.overlong_penalty_factor, ge=0)

    def _migrate_legacy_rejection_sampling(self) -> None:
        legacy_set = (
            self.behav_imp_weight_cap is not None or self.behave_imp_weight_mode != "token_mask"
        )
        if not legacy_set:
            return
        migrated = legacy_rejection_sampling(self.behav_imp_weight_cap, self.behave_imp_weight_mode)
        if self.rejection_sampling is not None and self.rejection_sampling != migrated:
            raise ValueError(
                f"{type(self).__name__}: both the deprecated behave_imp_weight_cap="
                f"{self.behav_imp_weight_cap!r} / behave_imp_weight_mode="
                f"{self.behave_imp_weight_mode!r} and rejection_sampling={self.rejection_sampling!r} "
                "are set and disagree; keep only rejection_sampling"
            )
        self.rejection_sampling = migrated
        shown = (
            "null"
            if migrated is None
            else (
                f"{{level: {migrated.level}, action: {migrated.action}, metric: ratio, "
                f"upper: {migrated.upper}}}"
            )
        )
        _warn_once(
            f"legacy-rs-{self.behav_imp_weight_cap}-{self.behave_imp_weight_mode}",
            "behave_imp_weight_cap / behave_imp_weight_mode (and behav_imp_weight_cap) are "
            f"deprecated; migrated to rejection_sampling: {shown}. Write that instead.",
        )

    def should_compute_prox_logp(self) -> bool:
        """Whether the training engine must recompute logprobs before the PPO update."""
        if self.use_decoupled_loss:
            return self.prox_logp_method != "loglinear"
        return self.recompute_logprob


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """The value model of PPO (trained by clipped value regression)."""

    ppo_n_minibatches: int = _field(4, "Mini-batches per PPO update; >= 1.")
    eps_clip: float = _field(0.5, "Clip range of the value update around the old values; > 0.")
    mask_no_eos_with_zero: bool = _field(
        False, "Exclude truncated responses (no EOS) from the value loss."
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        _check_range(owner, "ppo_n_minibatches", self.ppo_n_minibatches, ge=1)
        _check_range(owner, "eps_clip", self.eps_clip, gt=0)


@dataclass
class TeacherConfig(PPOActorConfig):
    """Teacher model for on-policy distillation. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    rl_loss_weight: float = _field(1.0, "Weight of the RL loss.")
    distill_loss_weight: float = _field(0.005, "Weight of the distillation loss.")


# =====================================================================================
# Inference servers and rollout
# =====================================================================================


VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SGLANG_SERVER_MODULE = "sglang.launch_server"


def get_py_cmd(module: str, args: dict[str, Any], python: str = "python3") -> list[str]:
    """``[python, -m, module]`` plus one ``--flag-name`` per argument.

    ``None``, ``False``, ``""`` and ``[]`` are left out; ``True`` gives a bare flag; a
    list gives the flag followed by its items; anything else the flag and ``str(value)``.
    Underscores in names become dashes.
    """
    cmd = [python, "-m", module]
    for name, value in args.items():
        if (
            value is None
            or value is False
            or value == ""
            or (isinstance(value, (list, tuple)) and not value)
        ):
            continue
        flag = "--" + name.replace("_", "-")
        cmd.append(flag)
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            cmd.extend(str(v) for v in value)
        else:
            cmd.append(str(value))
    return cmd


def split_host_port(addr: str) -> tuple[str, int]:
    """``'host:port'`` (or ``'[v6::addr]:port'``) -> ``(host, port)``; ValueError otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {addr!r} is not 'host:port'")
    return host.strip("[]"), int(port)


@dataclass
class vLLMConfig:
    """Arguments of vLLM servers (backend 'vllm'), passed on as `--flag value`."""

    model: str = _field("", "Model directory or hub name served by vLLM (usually ${actor.path}).")
    seed: int = _field(1, "Random seed of the server.")
    skip_tokenizer_init: bool = _field(False, "Do not load a tokenizer (requests carry token ids).")
    enforce_eager: bool = _field(False, "Disable CUDA graphs / compilation.")
    dtype: str = _field("bfloat16", "Model dtype in the server.")
    distributed_executor_backend: str = _field("mp", "vLLM executor for multi-GPU: 'mp' or 'ray'.")
    max_num_seqs: int = _field(256, "Maximum concurrent sequences per server.")
    block_size: int = _field(16, "KV-cache block size in tokens.")
    swap_space: int = _field(4, "CPU swap space per GPU in GiB.")
    cpu_offload_gb: float = _field(0, "GiB of weights offloaded to CPU.")
    disable_sliding_window: bool = _field(True, "Disable sliding-window attention.")
    max_model_len: int | None = _field(32768, "Context length; None for the model's own.")
    no_enable_chunked_prefill: bool = _field(False, "Pass --no-enable-chunked-prefill.")
    no_enable_prefix_caching: bool = _field(
        True,
        "Pass --no-enable-prefix-caching (stale cache entries after weight updates otherwise).",
    )
    gpu_memory_utilization: float = _field(0.9, "Fraction of GPU memory vLLM may use.")
    worker_extension_cls: str = _field(
        "", "Import path of a vLLM worker extension class (weight updates); empty: none."
    )
    enable_sleep_mode: bool = _field(False, "Allow the server to release GPU memory while idle.")
    uvicorn_log_level: str = _field("warning", "Log level of the HTTP server.")
    enable_lora: bool = _field(False, "Serve LoRA adapters. " + _NOT_ACTED)
    max_lora_rank: int = _field(16, "Maximum LoRA rank. " + _NOT_ACTED)
    max_loras: int = _field(8, "Maximum LoRA adapters at once. " + _NOT_ACTED)
    lora_modules: list[str] | None = _field(None, "LoRA modules to serve. " + _NOT_ACTED)

    @staticmethod
    def build_args(
        vllm_config: vLLMConfig,
        tp_size: int,
        pp_size: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
    ) -> dict[str, Any]:
        """Server arguments (``{name: value}``) of one vLLM server for this config.

        Every field of the config, plus the tokenizer (= ``model``), ``load_format='auto'``,
        ``trust_remote_code``, the tensor/pipeline-parallel sizes, host and port; with
        ``n_nodes > 1`` also ``nnodes``, ``node_rank``, ``master_addr`` / ``master_port``
        (from ``dist_init_addr`` 'host:port') and ``headless`` on non-zero ranks.
        """
        args: dict[str, Any] = {
            "tokenizer": vllm_config.model,
            "load_format": "auto",
            "trust_remote_code": True,
            "tensor_parallel_size": tp_size,
            "pipeline_parallel_size": pp_size,
        }
        args.update(conf_as_dict(vllm_config))
        if port is not None:
            args["port"] = port
        if host is not None:
            args["host"] = host
        if n_nodes > 1:
            args["nnodes"] = n_nodes
            args["node_rank"] = node_rank
            if dist_init_addr is not None:
                master_host, master_port = split_host_port(dist_init_addr)
                args["master_addr"] = master_host
                args["master_port"] = str(master_port)
            if node_rank > 0:
                args["headless"] = True
        return args

    @staticmethod
    def build_cmd_from_args(args: dict[str, Any], python: str = "python3") -> list[str]:
        """``[python, -m, vllm.entrypoints.openai.api_server, --flag, value, ...]``."""
        return get_py_cmd(VLLM_SERVER_MODULE, args, python=python)

    @staticmethod
    def build_cmd(
        vllm_config: vLLMConfig,
        tp_size: int,
        pp_size: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
    ) -> list[str]:
        """Command line of one vLLM server: ``build_cmd_from_args(build_args(...))``."""
        args = vLLMConfig.build_args(
            vllm_config=vllm_config,
            tp_size=tp_size,
            pp_size=pp_size,
            host=host,
            port=port,
            dist_init_addr=dist_init_addr,
            n_nodes=n_nodes,
            node_rank=node_rank,
        )
        return vLLMConfig.build_cmd_from_args(args)


@dataclass
class SGLangConfig:
    """Arguments of SGLang servers (backend 'sglang'), passed on as `--flag value`."""

    model_path: str = _field(
        "", "Model directory or hub name served by SGLang (usually ${actor.path})."
    )
    random_seed: int = _field(1, "Random seed of the server.")
    skip_tokenizer_init: bool = _field(False, "Do not load a tokenizer (requests carry token ids).")
    disable_cuda_graph: bool = _field(False, "Disable CUDA graphs.")
    disable_radix_cache: bool = _field(True, "Disable the prefix (radix) cache.")
    disable_cuda_graph_padding: bool = _field(False, "Disable CUDA-graph padding.")
    enable_nccl_nvls: bool = _field(False, "Enable NCCL NVLS.")
    disable_outlines_disk_cache: bool = _field(False, "Disable the outlines disk cache.")
    disable_custom_all_reduce: bool = _field(False, "Disable the custom all-reduce kernel.")
    disable_overlap_schedule: bool = _field(False, "Disable the overlap scheduler.")
    enable_mixed_chunk: bool = _field(False, "Mix prefill and decode in one batch.")
    enable_dp_attention: bool = _field(False, "Data-parallel attention.")
    enable_ep_moe: bool = _field(False, "Expert-parallel MoE.")
    enable_torch_compile: bool = _field(False, "torch.compile the model.")
    torch_compile_max_bs: int = _field(32, "Maximum batch size compiled.")
    cuda_graph_max_bs: int | None = _field(None, "Maximum CUDA-graph batch size.")
    cuda_graph_bs: list[int] | None = _field(None, "CUDA-graph batch sizes.")
    torchao_config: str = _field("", "torchao quantisation config.")
    enable_nan_detection: bool = _field(False, "Detect NaNs in sampling.")
    enable_p2p_check: bool = _field(False, "Check GPU peer-to-peer access.")
    triton_attention_reduce_in_fp32: bool = _field(False, "fp32 reduction in triton attention.")
    triton_attention_num_kv_splits: int = _field(8, "KV splits of triton attention.")
    num_continuous_decode_steps: int = _field(1, "Decode steps per scheduling round.")
    enable_memory_saver: bool = _field(False, "Allow releasing GPU memory while idle.")
    allow_auto_truncate: bool = _field(False, "Truncate over-long prompts instead of failing.")
    attention_backend: str | None = _field("fa3", "Attention backend.")
    enable_multimodal: bool = _field(False, "Enable multimodal inputs.")
    sampling_backend: str | None = _field(None, "Sampling backend.")
    context_length: int | None = _field(32768, "Context length; None for the model's own.")
    mem_fraction_static: float | None = _field(
        0.9, "Fraction of GPU memory for weights + KV cache."
    )
    max_running_requests: int | None = _field(None, "Maximum concurrent requests.")
    chunked_prefill_size: int | None = _field(-1, "Chunked prefill size; -1 disables.")
    max_prefill_tokens: int = _field(32768, "Maximum tokens of one prefill batch.")
    schedule_policy: str = _field("lpm", "Request scheduling policy of the server.")
    schedule_conservativeness: float = _field(1.0, "Scheduling conservativeness.")
    cpu_offload_gb: int = _field(0, "GiB of weights offloaded to CPU.")
    dtype: str = _field("bfloat16", "Model dtype in the server.")
    kv_cache_dtype: str = _field("auto", "KV-cache dtype.")
    dp_size: int = _field(1, "Data-parallel size for DP attention.")
    ep_size: int = _field(1, "Expert-parallel size.")
    enable_lora: bool | None = _field(None, "Serve LoRA adapters. " + _NOT_ACTED)
    max_lora_rank: int | None = _field(None, "Maximum LoRA rank. " + _NOT_ACTED)
    max_loaded_loras: int = _field(8, "Maximum loaded LoRA adapters. " + _NOT_ACTED)
    lora_paths: list[str] | None = _field(None, "LoRA adapter paths. " + _NOT_ACTED)
    lora_backend: str = _field("triton", "LoRA kernel backend. " + _NOT_ACTED)
    log_level: str = _field("warning", "Server log level.")
    log_level_http: str | None = _field("warning", "HTTP log level.")
    log_requests: bool = _field(False, "Log every request.")
    log_requests_level: int = _field(0, "Verbosity of request logging.")
    show_time_cost: bool = _field(False, "Log time costs.")
    enable_metrics: bool = _field(True, "Export Prometheus metrics.")
    decode_log_interval: int = _field(1, "Decode iterations between throughput logs.")
    enable_multithread_load: bool = _field(False, "Multi-threaded weight loading.")
    enable_return_routed_experts: bool = _field(False, "Return MoE routing (internal).")

    @staticmethod
    def build_args(
        sglang_config: SGLangConfig,
        tp_size: int,
        base_gpu_id: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
        pp_size: int = 1,
    ) -> dict[str, Any]:
        """Server arguments (``{name: value}``) of one SGLang server for this config.

        Every field of the config (``enable_multithread_load`` becomes the JSON
        ``model_loader_extra_config``), plus ``tokenizer_path`` (= ``model_path``),
        ``tokenizer_mode`` / ``load_format`` 'auto', ``trust_remote_code``,
        ``is_embedding=False``, ``tp_size``, ``base_gpu_id``, ``nnodes``, ``node_rank``,
        ``dist_init_addr``, and ``pp_size`` (when > 1), host and port when given.
        """
        fields_ = conf_as_dict(sglang_config)
        multithread = fields_.pop("enable_multithread_load", False)
        if multithread:
            fields_["model_loader_extra_config"] = json.dumps(
                {"enable_multithread_load": True}, separators=(",", ":")
            )
        args: dict[str, Any] = {
            "tokenizer_path": sglang_config.model_path,
            "tokenizer_mode": "auto",
            "load_format": "auto",
            "trust_remote_code": True,
            "is_embedding": False,
            "tp_size": tp_size,
            "base_gpu_id": base_gpu_id,
            "nnodes": n_nodes,
            "node_rank": node_rank,
            "dist_init_addr": dist_init_addr,
        }
        args.update(fields_)
        if pp_size > 1:
            args["pp_size"] = pp_size
        if host is not None:
            args["host"] = host
        if port is not None:
            args["port"] = port
        return args

    @staticmethod
    def build_cmd_from_args(args: dict[str, Any], python: str = "python3") -> list[str]:
        """``[python, -m, sglang.launch_server, --flag, value, ...]``."""
        return get_py_cmd(SGLANG_SERVER_MODULE, args, python=python)

    @staticmethod
    def build_cmd(
        sglang_config: SGLangConfig,
        tp_size: int,
        base_gpu_id: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
        pp_size: int = 1,
    ) -> list[str]:
        """Command line of one SGLang server: ``build_cmd_from_args(build_args(...))``."""
        args = SGLangConfig.build_args(
            sglang_config=sglang_config,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            host=host,
            port=port,
            dist_init_addr=dist_init_addr,
            n_nodes=n_nodes,
            node_rank=node_rank,
            pp_size=pp_size,
        )
        return SGLangConfig.build_cmd_from_args(args)


def _default_agent_scheduling_spec() -> list[SchedulingSpec]:
    return [SchedulingSpec(cpu=1, gpu=0, mem=4)]


_AGENT_MODES = ["inline", "subproc", "online"]


@dataclass
class AgentConfig:
    """Agent workflows: the OpenAI-compatible proxy they talk to and the agent service.

    Holds what AReaL's earlier ``rollout.openai`` (OpenAIProxyConfig) section held, plus
    the agent class and the agent-service workers.
    """

    agent_cls_path: str = _field(
        "", "Import path ('pkg.module.Class') of the agent implementation; empty: none."
    )
    admin_api_key: str = _field(
        "areal-admin-key",
        "Admin key of the proxy and agent service (management calls only; each session "
        "gets its own key). Change it for anything beyond localhost.",
    )
    scheduling_spec: list[SchedulingSpec] = _field(
        help="Resources of the agent-service worker; exactly one spec.",
        factory=_default_agent_scheduling_spec,
    )
    mode: str = _field(
        "inline",
        "'inline' (agent runs in the rollout process), 'subproc' (in a worker process "
        "pool) or 'online' (external users drive sessions through the proxy).",
        choices=_AGENT_MODES,
    )
    tool_call_parser: str = _field("qwen", "Parser of tool calls in model output.")
    reasoning_parser: str = _field("qwen3", "Parser of reasoning content (<think> tags).")
    chat_template_type: str = _field(
        "hf",
        "'hf' (the tokenizer's chat template) or 'concat' (multi-turn concatenation).",
        choices=["hf", "concat"],
    )
    engine_max_tokens: int | None = _field(
        None, "Maximum prompt + completion tokens of one call; None: no limit."
    )
    turn_discount: float = _field(1.0, "Reward discount per turn of a multi-turn episode.")
    export_style: str = _field(
        "individual",
        "'individual': every interaction is a training sample; 'concat': only the final "
        "concatenated conversation (linear histories only).",
        choices=["individual", "concat"],
    )
    subproc_max_workers: int = _field(4, "Worker processes in 'subproc' mode; >= 1.")
    session_timeout_seconds: int = _field(3600, "Sessions idle longer than this are dropped; > 0.")
    set_reward_finish_timeout: float = _field(
        0.0, "Seconds to wait for further reward updates before a session is final; >= 0."
    )

    def __post_init__(self):
        owner = "AgentConfig"
        _check_choice(owner, "mode", self.mode, _AGENT_MODES)
        _check_choice(owner, "chat_template_type", self.chat_template_type, ["hf", "concat"])
        _check_choice(owner, "export_style", self.export_style, ["individual", "concat"])
        if len(self.scheduling_spec) != 1:
            raise ValueError(
                f"{owner}.scheduling_spec has {len(self.scheduling_spec)} entries; must have exactly 1"
            )
        if not self.admin_api_key or not self.admin_api_key.strip():
            raise ValueError(f"{owner}.admin_api_key is empty; it must be a non-blank string")
        _check_range(owner, "subproc_max_workers", self.subproc_max_workers, ge=1)
        _check_range(owner, "session_timeout_seconds", self.session_timeout_seconds, gt=0)
        _check_range(owner, "set_reward_finish_timeout", self.set_reward_finish_timeout, ge=0)
        _check_range(owner, "engine_max_tokens", self.engine_max_tokens, ge=1, optional=True)


# Earlier AReaL name of the proxy section (rollout.openai); its fields are AgentConfig's.
OpenAIProxyConfig = AgentConfig


@dataclass
class InferenceEngineConfig:
    """Rollout: inference servers, request policy and staleness control."""

    experiment_name: str | None = _field(
        None, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str | None = _field(None, "Trial name; defaults to the top-level trial_name.")
    backend: str = _field(
        "",
        "Inference backend and parallel sizes, e.g. 'local:d1', 'vllm:d2t2', 'sglang:d4'. "
        "Empty: taken from the top-level allocation_mode.",
    )
    max_concurrent_rollouts: int | None = _field(
        None, "Maximum rollouts in flight at once; None: consumer_batch_size; >= 1."
    )
    queue_size: int | None = _field(
        None, "Capacity of the input/output rollout queues; None: unbounded-ish default; >= 1."
    )
    consumer_batch_size: int = _field(
        1, "Trajectories the trainer takes per step (usually ${train_dataset.batch_size}); >= 1."
    )
    max_head_offpolicyness: int = _field(
        0,
        "Maximum staleness: a rollout may start only while its policy version is at most "
        "this many versions behind the trainer; 0 = synchronous RL; >= 0.",
    )
    enable_rollout_tracing: bool = _field(False, "Log every generation request verbosely.")
    check_trajectory_format: bool = _field(
        False, "Check the tensors each workflow returns (for debugging workflows)."
    )
    schedule_policy: str = _field(
        "round_robin", "How requests are spread over servers.", choices=["round_robin"]
    )
    fileroot: str | None = _field(
        None, "Root directory of trajectory dumps (usually ${cluster.fileroot})."
    )
    tokenizer_path: str = _field("", "Tokenizer used to decode dumped trajectories.")
    dump_to_file: bool = _field(False, "Dump every trajectory as text under fileroot.")
    setup_timeout: float = _field(300.0, "Seconds to wait for servers to become healthy; > 0.")
    request_timeout: float = _field(
        3600, "Seconds before an HTTP generation request times out; > 0."
    )
    request_retries: int = _field(3, "Retries of a failed request; >= 0.")
    pause_grace_period: float = _field(
        0.0, "Seconds to wait after pausing servers before weights are updated; >= 0."
    )
    scheduling_spec: list[SchedulingSpec] = _field(
        help="Worker resources of the rollout role (single-controller schedulers).",
        factory=_default_scheduling_spec,
    )
    scheduling_strategy: SchedulingStrategy = _field(
        help="Own workers ('separation') or another role's ('colocation').",
        factory=SchedulingStrategy,
    )
    use_lora: bool = _field(False, "Serve LoRA adapters. " + _NOT_ACTED)
    agent: AgentConfig = _field(
        help="Agent workflows: OpenAI-compatible proxy and agent service.", factory=AgentConfig
    )
    openai: AgentConfig | None = _field(
        None,
        "DEPRECATED (AReaL's earlier name of `agent`): moved into rollout.agent with a warning.",
    )
    return_routed_experts: bool = _field(False, "Return MoE routing (SGLang). " + _NOT_ACTED)
    _version: str = _field(
        "v1",
        "AReaL's rollout-controller version: 'v1' (this project's controller) or 'v2' (AReaL's "
        "inference-service gateway). " + _NOT_ACTED,
        choices=["v1", "v2"],
    )
    model: str = _field("default", "Model name exposed by the gateway (v2). " + _NOT_ACTED)
    routing_strategy: str = _field("round_robin", "Gateway routing (v2). " + _NOT_ACTED)
    poll_interval: float = _field(5.0, "Gateway health-poll seconds (v2). " + _NOT_ACTED)
    admin_api_key: str = _field("areal-admin-key", "Gateway admin key (v2). " + _NOT_ACTED)
    api_url: str | None = _field(
        None, "External OpenAI-compatible base URL (v2 external model). " + _NOT_ACTED
    )
    provider_api_key: str | None = _field(
        None, "API key of the external provider (v2). " + _NOT_ACTED
    )

    def __post_init__(self):
        owner = "InferenceEngineConfig"
        if self.openai is not None:
            if self.agent != AgentConfig() and self.agent != self.openai:
                raise ValueError(
                    f"{owner}: both the deprecated `openai` section and `agent` are set and "
                    "disagree; keep only `agent`"
                )
            self.agent = self.openai
            _warn_once(
                "rollout-openai",
                "rollout.openai is deprecated; its settings were moved to rollout.agent. "
                "Rename the section to `agent`.",
            )
        _check_range(
            owner, "max_concurrent_rollouts", self.max_concurrent_rollouts, ge=1, optional=True
        )
        _check_range(owner, "queue_size", self.queue_size, ge=1, optional=True)
        _check_range(owner, "consumer_batch_size", self.consumer_batch_size, ge=1)
        _check_range(owner, "max_head_offpolicyness", self.max_head_offpolicyness, ge=0)
        _check_choice(owner, "schedule_policy", self.schedule_policy, ["round_robin"])
        _check_range(owner, "setup_timeout", self.setup_timeout, gt=0)
        _check_range(owner, "request_timeout", self.request_timeout, gt=0)
        _check_range(owner, "request_retries", self.request_retries, ge=0)
        _check_range(owner, "pause_grace_period", self.pause_grace_period, ge=0)
        if len(self.scheduling_spec) not in (1, 2):
            raise ValueError(
                f"{owner}.scheduling_spec has {len(self.scheduling_spec)} entries; must have 1 or 2"
            )
        if self.backend:
            from areal.api.alloc_mode import ParallelStrategy

            ParallelStrategy.parse_backend(self.backend, field_name=f"{owner}.backend")


# =====================================================================================
# Datasets
# =====================================================================================


@dataclass
class DatasetConfig:
    """A dataset and its dataloader."""

    path: str = _field(
        MISSING, "Dataset location: a local file/directory (nothing is downloaded at run time)."
    )
    type: str = _field(MISSING, "What the samples are used for: 'sft' or 'rl'.")
    split: str = _field("train", "Dataset split to load, e.g. 'train' or 'test'.")
    dataset_kwargs: dict[str, Any] = _field(
        help="Extra keyword arguments passed to the dataset loader.", factory=dict
    )
    batch_size: int = _field(1, "Prompts per batch (per training step); >= 1.")
    shuffle: bool = _field(True, "Shuffle every epoch.")
    max_length: int | None = _field(
        None, "Drop samples whose prompt is longer than this many tokens; None: keep all."
    )
    drop_last: bool = _field(True, "Drop the last incomplete batch.")
    pin_memory: bool = _field(False, "Pin host memory (GPU training only).")
    num_workers: int = _field(0, "Dataloader worker processes; >= 0.")
    num_dataset_workers: int = _field(1, "Workers of AReaL's remote data service. " + _NOT_ACTED)
    scheduling_spec: SchedulingSpec | None = _field(
        help="Resources of AReaL's remote data-service workers. " + _NOT_ACTED,
        factory=lambda: SchedulingSpec(cpu=1, gpu=0, mem=10),
    )
    setup_timeout: float = _field(
        120.0, "Seconds the remote data service may take to load a dataset. " + _NOT_ACTED
    )

    def __post_init__(self):
        owner = type(self).__name__
        _check_range(owner, "batch_size", self.batch_size, ge=1)
        _check_range(owner, "num_workers", self.num_workers, ge=0)
        _check_range(owner, "max_length", self.max_length, ge=1, optional=True)


# AReaL's name of the shared base of the dataset sections.
_DatasetConfig = DatasetConfig


@dataclass
class TrainDatasetConfig(DatasetConfig):
    """The training dataset."""


@dataclass
class ValidDatasetConfig(DatasetConfig):
    """The validation dataset; split 'test', not shuffled, keeps its last batch by default."""

    split: str = _field("test", "Dataset split to load, e.g. 'train' or 'test'.")
    shuffle: bool = _field(False, "Shuffle every epoch.")
    drop_last: bool = _field(False, "Drop the last incomplete batch.")


# =====================================================================================
# Saving, evaluation, recovery, logging
# =====================================================================================


@dataclass
class _Timer:
    experiment_name: str = _field(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = _field(MISSING, "Trial name; defaults to the top-level trial_name.")
    fileroot: str = _field(MISSING, "Root directory of outputs; defaults to cluster.fileroot.")
    freq_epochs: int | None = _field(
        None, "Trigger every this many epochs; None: never by epochs; >= 1."
    )
    freq_steps: int | None = _field(
        None, "Trigger every this many steps; None: never by steps; >= 1."
    )
    freq_secs: int | None = _field(
        None, "Trigger every this many seconds; None: never by time; >= 1."
    )

    def __post_init__(self):
        owner = type(self).__name__
        for name in ("freq_epochs", "freq_steps", "freq_secs"):
            _check_range(owner, name, getattr(self, name), ge=1, optional=True)


@dataclass
class SaverConfig(_Timer):
    """When HuggingFace-format checkpoints are saved."""

    mode: str = _field(
        "auto",
        "'auto' (synchronous here), 'sync' or 'async' saving.",
        choices=["auto", "sync", "async"],
    )

    def __post_init__(self):
        super().__post_init__()
        _check_choice("SaverConfig", "mode", self.mode, ["auto", "sync", "async"])


@dataclass
class EvaluatorConfig(_Timer):
    """When the model is evaluated on the validation set."""

    eval_before_train: bool = _field(
        False, "Evaluate once before the first training step, then on the usual schedule."
    )


_RECOVER_MODES = ["on", "off", "auto", "disabled"]


@dataclass
class RecoverConfig(_Timer):
    """Recovery checkpoints (model, optimizer, dataloader, counters) and resuming from them."""

    mode: str = _field(
        "disabled",
        "'on'/'auto': resume from the last recovery checkpoint when one exists; "
        "'off'/'disabled': always start fresh.",
        choices=_RECOVER_MODES,
    )
    retries: int = _field(3, "How many times a failed run is restarted when recovery is on; >= 0.")
    no_save_optim: bool = _field(False, "Leave optimizer states out of recovery checkpoints.")
    no_load_optim: bool = _field(False, "Do not restore optimizer states when resuming.")

    def __post_init__(self):
        super().__post_init__()
        _check_choice("RecoverConfig", "mode", self.mode, _RECOVER_MODES)
        _check_range("RecoverConfig", "retries", self.retries, ge=0)


_WANDB_MODES = ["online", "offline", "disabled"]


@dataclass
class WandBConfig:
    """Weights & Biases logging (needs the optional `wandb` package unless disabled)."""

    mode: str = _field("disabled", "'online', 'offline' or 'disabled'.", choices=_WANDB_MODES)
    wandb_base_url: str = _field("", "W&B server URL; empty for the default.")
    wandb_api_key: str = _field("", "W&B API key; empty: taken from the environment.")
    entity: str | None = _field(None, "W&B entity (team or user).")
    project: str | None = _field(None, "W&B project; None: experiment_name.")
    name: str | None = _field(None, "Run name; None: trial_name.")
    job_type: str | None = _field(None, "W&B job type.")
    group: str | None = _field(None, "W&B run group.")
    notes: str | None = _field(None, "Run notes.")
    tags: list[str] | None = _field(None, "Run tags.")
    config: dict | None = _field(None, "Extra run config.")
    id_suffix: str | None = _field("train", "Suffix of the run id.")

    def __post_init__(self):
        _check_choice("WandBConfig", "mode", self.mode, _WANDB_MODES)


@dataclass
class SwanlabConfig:
    """SwanLab logging. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    project: str | None = _field(None, "SwanLab project.")
    name: str | None = _field(None, "Run name.")
    config: dict | None = _field(None, "Extra run config.")
    logdir: str | None = _field(None, "Local log directory.")
    mode: str | None = _field("disabled", "SwanLab mode, e.g. 'cloud', 'local' or 'disabled'.")
    api_key: str | None = _field(None, "API key; None: taken from SWANLAB_API_KEY at run time.")


@dataclass
class TensorBoardConfig:
    """TensorBoard logging."""

    path: str | None = _field(None, "Directory of TensorBoard event files; None: no TensorBoard.")


@dataclass
class TrackioConfig:
    """Trackio logging. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    mode: str = _field(
        "disabled", "'disabled', 'online' or 'local'.", choices=["disabled", "online", "local"]
    )
    project: str | None = _field(None, "Project; None: experiment_name.")
    name: str | None = _field(None, "Run name; None: trial_name.")
    space_id: str | None = _field(None, "HuggingFace Space for a remote dashboard.")

    def __post_init__(self):
        _check_choice("TrackioConfig", "mode", self.mode, ["disabled", "online", "local"])


@dataclass
class StatsLoggerConfig:
    """Where training statistics go (log file always; W&B / TensorBoard optionally)."""

    experiment_name: str = _field(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = _field(MISSING, "Trial name; defaults to the top-level trial_name.")
    fileroot: str = _field(MISSING, "Root directory of logs; defaults to cluster.fileroot.")
    wandb: WandBConfig = _field(help="Weights & Biases.", factory=WandBConfig)
    tensorboard: TensorBoardConfig = _field(help="TensorBoard.", factory=TensorBoardConfig)
    swanlab: SwanlabConfig = _field(help="SwanLab. " + _NOT_ACTED, factory=SwanlabConfig)
    trackio: TrackioConfig = _field(help="Trackio. " + _NOT_ACTED, factory=TrackioConfig)


@dataclass
class SessionTracerConfig:
    """Per-session lifecycle tracing. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    enabled: bool = _field(False, "Record session lifecycles.")
    flush_threshold: int = _field(256, "Records buffered before a flush.")


@dataclass
class MemoryProfilerConfig:
    """CUDA memory snapshots. This project accepts it so AReaL YAMLs load, but does not act on it (needs CUDA)."""

    profile_steps: list[int] = _field(
        help="Steps at which a memory snapshot is taken.", factory=lambda: [0, 1]
    )
    max_entries: int = _field(100000, "Entries of the memory-history ring buffer.")


@dataclass
class PerfTracerConfig:
    """Performance tracing. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    experiment_name: str = _field(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = _field(MISSING, "Trial name; defaults to the top-level trial_name.")
    fileroot: str = _field(MISSING, "Root directory; defaults to cluster.fileroot.")
    enabled: bool = _field(False, "Capture performance traces.")
    save_interval: int = _field(1, "Flush traces every this many steps.")
    profile_steps: list[int] | None = _field(None, "Steps with detailed profiles.")
    session_tracer: SessionTracerConfig | None = _field(None, "Session tracing.")


# =====================================================================================
# Cluster, scheduler, launcher
# =====================================================================================


@dataclass
class NameResolveConfig:
    """Key-value store through which processes find each other's addresses."""

    type: str = _field(
        "nfs",
        "'nfs' (files under nfs_record_root; also works on one machine), 'etcd3' or 'ray'.",
        choices=["nfs", "etcd3", "ray"],
    )
    nfs_record_root: str = _field(
        "/tmp/areal/name_resolve", "Directory of the records; must be shared by all nodes."
    )
    etcd3_addr: str = _field("localhost:2379", "host:port of the etcd3 server.")
    ray_actor_name: str = _field("ray_kv_store", "Name of the Ray actor holding the store.")

    def __post_init__(self):
        _check_choice("NameResolveConfig", "type", self.type, ["nfs", "etcd3", "ray"])


@dataclass
class ClusterSpecConfig:
    """The machines the experiment runs on."""

    fileroot: str = _field(
        "/tmp/areal/", "Root of logs and checkpoints; must be visible from every node."
    )
    n_nodes: int = _field(32, "Number of nodes available; >= 1.")
    n_gpus_per_node: int = _field(8, "GPUs per node; 0 on CPU-only machines; >= 0.")
    cluster_name: str = _field("local", "Cluster name (selects cluster-specific settings).")
    name_resolve: NameResolveConfig = _field(help="Address discovery.", factory=NameResolveConfig)

    def __post_init__(self):
        _check_range("ClusterSpecConfig", "n_nodes", self.n_nodes, ge=1)
        _check_range("ClusterSpecConfig", "n_gpus_per_node", self.n_gpus_per_node, ge=0)


_SCHEDULER_TYPES = ["local", "ray", "slurm", None]


@dataclass
class SchedulerConfig:
    """Which scheduler creates the worker processes."""

    type: str | None = _field(
        None,
        "'local' (subprocesses on this machine), 'ray' (Ray actors on a Ray cluster), "
        "'slurm' (Slurm jobs); None behaves as 'local'.",
        choices=_SCHEDULER_TYPES,
    )
    endpoint: str = _field("http://localhost:8081", "Scheduler service endpoint. " + _NOT_ACTED)
    deploy_mode: str = _field("separation", "Deployment mode. " + _NOT_ACTED)
    functioncall_service_domain: str = _field(
        "http://localhost:8080", "Function-call service. " + _NOT_ACTED
    )
    reward_functioncall_config: dict = _field(
        help="Reward function-call config. " + _NOT_ACTED, factory=dict
    )
    reward_model_path: str = _field("", "Reward model path. " + _NOT_ACTED)
    reward_model_service_url: str = _field(
        "http://localhost:30000/classify", "Reward model service. " + _NOT_ACTED
    )

    def __post_init__(self):
        _check_choice("SchedulerConfig", "type", self.type, _SCHEDULER_TYPES)


@dataclass
class SlurmLauncherConfig:
    """Slurm options of the launcher. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    srun_additional_args: str = _field("--mpi=pmi2 -K --chdir $PWD", "Extra srun arguments.")
    additional_bash_cmds: list[str] | None = _field(None, "Shell commands run before each task.")
    container_type: str = _field(
        "apptainer", "'apptainer' or 'none'.", choices=["apptainer", "none"]
    )
    mount: str = _field("/storage:/storage", "Container bind mount.")
    trainer_image: str | None = _field(None, "Container image of trainers.")
    inference_server_image: str | None = _field(None, "Container image of inference servers.")


@dataclass
class LauncherConfig:
    """Resources of launched processes (AReaL's SPMD launchers). This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    inference_server_cpus_per_gpu: int = _field(4, "CPUs per GPU of inference servers.")
    inference_server_mem_per_gpu: int = _field(
        32 * 1024, "Memory (MB) per GPU of inference servers."
    )
    trainer_cpus_per_gpu: int = _field(4, "CPUs per GPU of trainers.")
    trainer_mem_per_gpu: int = _field(32 * 1024, "Memory (MB) per GPU of trainers.")
    inference_server_env_vars: str = _field("", "Environment of inference servers, 'A=1,B=2'.")
    trainer_env_vars: str = _field("", "Environment of trainers, 'A=1,B=2'.")
    slurm: SlurmLauncherConfig = _field(help="Slurm options.", factory=SlurmLauncherConfig)
    offload: bool = _field(False, "Offload training memory between steps.")


# =====================================================================================
# Experiments
# =====================================================================================


@dataclass
class BaseExperimentConfig:
    """Settings shared by every experiment type."""

    experiment_name: str = _field(MISSING, "Name of the experiment (no '/'). Required.")
    trial_name: str = _field(MISSING, "Name of the trial (no '/'). Required.")
    cluster: ClusterSpecConfig = _field(
        help="Machines, file root and address discovery.", factory=ClusterSpecConfig
    )
    allocation_mode: str = _field(
        "",
        "Devices per component, e.g. 'local:d1+fsdp:d2' or 'sglang:d4t2+fsdp:d8' "
        "(see areal.api.alloc_mode). Per-engine `backend` fields take precedence.",
    )
    seed: int = _field(1, "Random seed.")
    total_train_epochs: int = _field(1, "Epochs over the training set; >= 1.")
    total_train_steps: int | None = _field(
        None, "Stop after this many steps; None: run all epochs."
    )
    total_train_n_seqs: int | None = _field(
        None, "Stop after this many training samples; None: no limit."
    )
    tokenizer_path: str = _field("", "Tokenizer directory or hub name (often ${actor.path}).")
    train_dataset: TrainDatasetConfig = _field(help="Training data.", factory=TrainDatasetConfig)
    valid_dataset: ValidDatasetConfig | None = _field(
        None, "Validation data; None: no evaluation set."
    )
    saver: SaverConfig = _field(help="HuggingFace checkpoint schedule.", factory=SaverConfig)
    evaluator: EvaluatorConfig = _field(help="Evaluation schedule.", factory=EvaluatorConfig)
    stats_logger: StatsLoggerConfig = _field(help="Statistics logging.", factory=StatsLoggerConfig)
    recover: RecoverConfig = _field(
        help="Recovery checkpoints and resuming.", factory=RecoverConfig
    )
    scheduler: SchedulerConfig = _field(help="Process scheduler.", factory=SchedulerConfig)
    sglang: SGLangConfig = _field(help="SGLang server arguments.", factory=SGLangConfig)
    vllm: vLLMConfig = _field(help="vLLM server arguments.", factory=vLLMConfig)
    enable_offload: bool = _field(
        False, "Offload training memory between steps (GPU). " + _NOT_ACTED
    )
    perf_tracer: PerfTracerConfig | None = _field(None, "Performance tracing. " + _NOT_ACTED)
    memory_profiler: MemoryProfilerConfig | None = _field(
        None, "CUDA memory snapshots. " + _NOT_ACTED
    )
    launcher: LauncherConfig = _field(
        help="Launcher resources. " + _NOT_ACTED, factory=LauncherConfig
    )

    def __post_init__(self):
        owner = type(self).__name__
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if isinstance(value, str) and "/" in value:
                raise ValueError(
                    f"{owner}.{name}={value!r} is not allowed; it must not contain '/'"
                )
        _check_range(owner, "total_train_epochs", self.total_train_epochs, ge=1)
        _check_range(owner, "total_train_steps", self.total_train_steps, ge=1, optional=True)
        _check_range(owner, "total_train_n_seqs", self.total_train_n_seqs, ge=1, optional=True)
        if self.allocation_mode:
            from areal.api.alloc_mode import AllocationMode

            AllocationMode.from_str(self.allocation_mode)


@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning. (A YAML section `model`, this project's earlier name, is
    read as `actor` with a warning.)"""

    actor: TrainEngineConfig = _field(help="The trained model.", factory=TrainEngineConfig)

    @property
    def model(self) -> TrainEngineConfig:
        """Read-only alias of ``actor`` (this project's earlier section name)."""
        return self.actor


@dataclass
class RWConfig(BaseExperimentConfig):
    """Reward-model training (a critic-style model with a scalar head, `actor.is_critic`).
    This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    actor: TrainEngineConfig = _field(
        help="The trained reward model; needs is_critic=True.", factory=TrainEngineConfig
    )

    @property
    def model(self) -> TrainEngineConfig:
        """Read-only alias of ``actor`` (this project's earlier section name)."""
        return self.actor

    def __post_init__(self):
        super().__post_init__()
        if not self.actor.is_critic:
            raise ValueError(
                "RWConfig.actor.is_critic=False is not allowed; a reward model needs a value "
                "head: set actor.is_critic: true"
            )


_DPO_LOSS_TYPES = ["sigmoid", "ipo"]


@dataclass
class DPOEngineConfig(TrainEngineConfig):
    """A model of DPO training (policy or reference) and the DPO loss settings."""

    beta: float = _field(0.1, "Strength of the implicit KL penalty of the DPO loss; > 0.")
    loss_type: str = _field(
        "sigmoid",
        "'sigmoid' (the original DPO loss) or 'ipo' (Identity Preference Optimization, "
        "length-normalised).",
        choices=_DPO_LOSS_TYPES,
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        _check_choice(owner, "loss_type", self.loss_type, _DPO_LOSS_TYPES)
        _check_range(owner, "beta", self.beta, gt=0)


@dataclass
class DPOConfig(BaseExperimentConfig):
    """Direct Preference Optimization. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    actor: DPOEngineConfig = _field(help="The trained policy.", factory=DPOEngineConfig)
    ref: DPOEngineConfig = _field(
        help="The frozen reference policy (no optimizer).", factory=DPOEngineConfig
    )

    def __post_init__(self):
        super().__post_init__()
        if self.actor.is_critic:
            raise ValueError(
                "DPOConfig.actor.is_critic=True is not allowed; DPO trains a language model"
            )


@dataclass
class PPOConfig(BaseExperimentConfig):
    """PPO-family RL (PPO with a critic, GRPO without one)."""

    gconfig: GenerationHyperparameters = _field(
        help="Sampling parameters of training rollouts.", factory=GenerationHyperparameters
    )
    rollout: InferenceEngineConfig = _field(
        help="Inference servers and staleness control.", factory=InferenceEngineConfig
    )
    actor: PPOActorConfig = _field(help="The policy and its loss.", factory=PPOActorConfig)
    ref: PPOActorConfig | None = _field(
        None, "Frozen reference model for the KL penalty; None: no reference."
    )
    critic: PPOCriticConfig | None = _field(None, "Value model; None: no critic (GRPO).")
    eval_gconfig: GenerationHyperparameters | None = _field(
        None, "Sampling parameters of evaluation; None: a copy of gconfig."
    )
    async_training: bool = _field(
        True,
        "Generate the next batches while training (bounded by rollout.max_head_offpolicyness). "
        "False: generate each batch only after the previous update.",
    )
    dynamic_bs: bool = _field(
        False,
        "Stop collecting a batch once accepted + rejected reaches batch_size (variable batch size).",
    )
    teacher: TeacherConfig | None = _field(None, "Distillation teacher. " + _NOT_ACTED)

    def __post_init__(self):
        if self.eval_gconfig is None:
            self.eval_gconfig = self.gconfig.new()
        super().__post_init__()


@dataclass
class GRPOConfig(PPOConfig):
    """GRPO: PPO without a critic, advantages from group-normalised rewards."""


# =====================================================================================
# Accepted but not acted on
# =====================================================================================

_MEGATRON = "the Megatron-LM training backend"
_ARCHON = "the Archon training backend"
_CUDA = "CUDA GPUs"
_GATEWAY = "AReaL's v2 gateway controller / inference service"
_LORA = "LoRA training and adapter sync (issue 15)"

# The one list of fields that load (so AReaL YAMLs work unchanged) but that this project
# does not act on, as (owner class, field, what it would need). A value other than the
# default is warned about once per run (warn_not_acted_on). docs/cli_reference.md
# renders this list.
NOT_ACTED_ON: tuple[tuple[str, str, str], ...] = (
    ("TrainEngineConfig", "megatron", _MEGATRON),
    ("TrainEngineConfig", "archon", _ARCHON),
    ("TrainEngineConfig", "offload", f"{_CUDA} (torch_memory_saver)"),
    ("TrainEngineConfig", "use_kernels", f"{_CUDA} (HuggingFace kernels)"),
    ("TrainEngineConfig", "enable_tree_training", f"{_CUDA} (flex-attention tree training)"),
    ("TrainEngineConfig", "use_lora", _LORA),
    ("TrainEngineConfig", "lora_rank", _LORA),
    ("TrainEngineConfig", "lora_alpha", _LORA),
    ("TrainEngineConfig", "target_modules", _LORA),
    ("TrainEngineConfig", "peft_type", _LORA),
    ("TrainEngineConfig", "_version", _GATEWAY),
    ("TrainEngineConfig", "admin_api_key", _GATEWAY),
    ("TrainEngineConfig", "log_level", _GATEWAY),
    ("TrainEngineConfig", "request_timeout", _GATEWAY),
    ("TrainEngineConfig", "setup_timeout", _GATEWAY),
    ("FSDPEngineConfig", "memory_efficient_load", f"{_CUDA} (rank-0 load + broadcast)"),
    ("FSDPEngineConfig", "per_layer_optim_step", _CUDA),
    ("FSDPEngineConfig", "optim_step_prefetch_layers", _CUDA),
    ("FSDPEngineConfig", "shard_vision_across_sp", "sequence parallelism"),
    ("OptimizerConfig", "initial_loss_scale", f"{_MEGATRON} (fp16 loss scaling)"),
    ("OptimizerConfig", "min_loss_scale", f"{_MEGATRON} (fp16 loss scaling)"),
    ("OptimizerConfig", "loss_scale_window", f"{_MEGATRON} (fp16 loss scaling)"),
    ("OptimizerConfig", "hysteresis", f"{_MEGATRON} (fp16 loss scaling)"),
    ("GenerationHyperparameters", "lora_name", _LORA),
    ("GenerationHyperparameters", "use_beam_search", "vLLM beam search"),
    ("InferenceEngineConfig", "use_lora", _LORA),
    ("InferenceEngineConfig", "return_routed_experts", "SGLang with MoE models"),
    ("InferenceEngineConfig", "agent", "agent workflows and the OpenAI proxy (issue 13)"),
    ("InferenceEngineConfig", "openai", "agent workflows and the OpenAI proxy (issue 13)"),
    ("InferenceEngineConfig", "_version", _GATEWAY),
    ("InferenceEngineConfig", "model", _GATEWAY),
    ("InferenceEngineConfig", "routing_strategy", _GATEWAY),
    ("InferenceEngineConfig", "poll_interval", _GATEWAY),
    ("InferenceEngineConfig", "admin_api_key", _GATEWAY),
    ("InferenceEngineConfig", "api_url", _GATEWAY),
    ("InferenceEngineConfig", "provider_api_key", _GATEWAY),
    ("vLLMConfig", "enable_lora", _LORA),
    ("vLLMConfig", "max_lora_rank", _LORA),
    ("vLLMConfig", "max_loras", _LORA),
    ("vLLMConfig", "lora_modules", _LORA),
    ("SGLangConfig", "enable_lora", _LORA),
    ("SGLangConfig", "max_lora_rank", _LORA),
    ("SGLangConfig", "max_loaded_loras", _LORA),
    ("SGLangConfig", "lora_paths", _LORA),
    ("SGLangConfig", "lora_backend", _LORA),
    ("DatasetConfig", "num_dataset_workers", "AReaL's remote data service"),
    ("DatasetConfig", "scheduling_spec", "AReaL's remote data service"),
    ("DatasetConfig", "setup_timeout", "AReaL's remote data service"),
    ("StatsLoggerConfig", "swanlab", "the SwanLab tracker (not integrated)"),
    ("StatsLoggerConfig", "trackio", "the Trackio tracker (not integrated)"),
    ("SchedulerConfig", "endpoint", "AReaL's scheduler service"),
    ("SchedulerConfig", "deploy_mode", "AReaL's scheduler service"),
    ("SchedulerConfig", "functioncall_service_domain", "AReaL's function-call service"),
    ("SchedulerConfig", "reward_functioncall_config", "AReaL's function-call service"),
    ("SchedulerConfig", "reward_model_path", "AReaL's reward-model service"),
    ("SchedulerConfig", "reward_model_service_url", "AReaL's reward-model service"),
    ("BaseExperimentConfig", "enable_offload", f"{_CUDA} (torch_memory_saver)"),
    ("BaseExperimentConfig", "perf_tracer", "AReaL's performance tracer"),
    ("BaseExperimentConfig", "memory_profiler", f"{_CUDA} (memory snapshots)"),
    ("BaseExperimentConfig", "launcher", "AReaL's SPMD launchers"),
    ("PPOConfig", "teacher", "on-policy distillation (issue 15)"),
)

# Fields that sub-sections inherit from the top level; not "set" by the user.
_INHERITED_NAMES = frozenset({"experiment_name", "trial_name", "fileroot"})


def _same_as_default(value: Any, default: Any) -> bool:
    """Equality that ignores inherited experiment_name / trial_name / fileroot."""
    if is_dataclass(value) and is_dataclass(default) and type(value) is type(default):
        return all(
            _same_as_default(getattr(value, f.name), getattr(default, f.name))
            for f in fields(value)
            if f.name not in _INHERITED_NAMES
        )
    if is_dataclass(value) and default is None:
        # An optional section written out with its defaults only (e.g. enabled: false).
        try:
            return _same_as_default(value, type(value)())
        except (TypeError, ValueError):
            return False
    return value == default


def _field_default(f: Any) -> Any:
    if f.default is not _DC_MISSING:
        return f.default
    if f.default_factory is not _DC_MISSING:
        return f.default_factory()
    return _DC_MISSING


def not_acted_on_settings(config: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted path, what it needs)`` of every NOT_ACTED_ON field set to a non-default value."""
    found: list[tuple[str, str]] = []
    if not is_dataclass(config) or isinstance(config, type):
        return found
    owners = {c.__name__ for c in type(config).__mro__}
    needs = {fname: why for owner, fname, why in NOT_ACTED_ON if owner in owners}
    for f in fields(config):
        value = getattr(config, f.name)
        path = f"{prefix}{f.name}"
        if f.name in needs:
            default = _field_default(f)
            if default is not _DC_MISSING and not _same_as_default(value, default):
                found.append((path, needs[f.name]))
            continue
        if is_dataclass(value):
            found.extend(not_acted_on_settings(value, path + "."))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                found.extend(not_acted_on_settings(item, f"{path}.{i}."))
    return found


def warn_not_acted_on(config: Any) -> list[str]:
    """Warn once per run about fields set that this project accepts but does not act on."""
    found = not_acted_on_settings(config)
    if found:
        listing = "; ".join(f"{path} (needs {why})" for path, why in found)
        _warn_once(
            "not-acted:" + ",".join(p for p, _ in found),
            f"These settings are accepted but not acted on here: {listing}. See "
            "docs/cli_reference.md, 'Accepted but not acted on'.",
        )
    return [p for p, _ in found]


# =====================================================================================
# CPU fallbacks
# =====================================================================================

# Train-engine dtypes the CPU path maps to float32 (see docs/cli_reference.md, "Running
# a GPU config on CPU"): torch runs bfloat16 on CPU, but measured on this project's
# 2-core CPU (no AVX512-BF16/AMX) a tiny-model train step took 10.1 s in bfloat16 vs
# 1.6 s in float32, and float16 matmuls on CPU are slower still or unsupported.
_CPU_DTYPE_FIELDS = ("dtype", "grad_reduce_dtype")


def _walk_dataclasses(obj: Any, prefix: str = ""):
    """(dotted path, instance) of ``obj`` and every dataclass nested in it (lists too)."""
    if not is_dataclass(obj) or isinstance(obj, type):
        return
    yield prefix.rstrip("."), obj
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from _walk_dataclasses(value, f"{prefix}{f.name}.")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from _walk_dataclasses(item, f"{prefix}{f.name}.{i}.")


def apply_cpu_fallbacks(config: Any) -> list[str]:
    """With ``cluster.n_gpus_per_node == 0``, make a GPU config runnable on CPU.

    Every ``SchedulingSpec.gpu`` > 0 becomes 0, and every train-engine ``dtype`` /
    ``grad_reduce_dtype`` other than float32 becomes float32; each kind is logged once,
    naming the changed keys. Returns the changed dotted keys. No-op for configs without
    a ``cluster`` section or with GPUs.
    """
    cluster = getattr(config, "cluster", None)
    if cluster is None or getattr(cluster, "n_gpus_per_node", None) != 0:
        return []
    gpu_keys: list[str] = []
    dtype_keys: list[str] = []
    for path, obj in _walk_dataclasses(config):
        if isinstance(obj, SchedulingSpec) and obj.gpu > 0:
            gpu_keys.append(f"{path}.gpu={obj.gpu}")
            obj.gpu = 0
        if isinstance(obj, TrainEngineConfig):
            for name in _CPU_DTYPE_FIELDS:
                value = getattr(obj, name)
                if value != "float32":
                    dtype_keys.append(f"{path}.{name}={value}")
                    setattr(obj, name, "float32")
    if gpu_keys:
        _warn_once(
            "cpu-gpu:" + ",".join(gpu_keys),
            "cluster.n_gpus_per_node=0: GPU requests dropped (set to 0): " + ", ".join(gpu_keys),
        )
    if dtype_keys:
        _warn_once(
            "cpu-dtype:" + ",".join(dtype_keys),
            "cluster.n_gpus_per_node=0: training dtypes mapped to float32 on CPU: "
            + ", ".join(dtype_keys),
        )
    return gpu_keys + dtype_keys


# =====================================================================================
# Loading
# =====================================================================================

_SUBSECTION_DEFAULTS = {
    "experiment_name": "${experiment_name}",
    "trial_name": "${trial_name}",
    "fileroot": "${cluster.fileroot}",
}


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; other types unchanged."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _dataclass_of(tp: Any) -> type | None:
    tp = _unwrap_optional(tp)
    return tp if isinstance(tp, type) and is_dataclass(tp) else None


def _list_item_dataclass(tp: Any) -> type | None:
    tp = _unwrap_optional(tp)
    if typing.get_origin(tp) in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(args) == 1:
            return _dataclass_of(args[0])
    return None


def _check_unknown_keys(node: Any, cls: type, prefix: str) -> None:
    """Raise ValueError for the first key of ``node`` that ``cls`` does not have."""
    if not isinstance(node, dict):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in hints or key not in names:
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ValueError(f"Unknown config key '{full}' in {cls.__name__}{hint}")
        sub = _dataclass_of(hints[key])
        if sub is not None:
            if value is not None and not isinstance(value, dict) and not _is_interpolation(value):
                raise ValueError(
                    f"Config key '{full}' is a section ({describe_type(hints[key])}); "
                    f"got the value {value!r}"
                )
            _check_unknown_keys(value, sub, full + ".")
            continue
        item = _list_item_dataclass(hints[key])
        if item is not None and isinstance(value, list):
            for i, entry in enumerate(value):
                _check_unknown_keys(entry, item, f"{full}[{i}].")


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.strip().startswith("${")


def _split_argv(argv: list[str]) -> tuple[str, list[str]]:
    if argv and argv[0].endswith(".py"):
        argv = argv[1:]
    config_file = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML file path after it")
            config_file = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif ("=" in arg and not arg.startswith("-")) or arg.startswith("~"):
            overrides.append(arg)
        else:
            raise ValueError(
                f"Cannot parse command-line argument {arg!r}; expected '--config FILE.yaml', "
                "'key.sub=value', '+key.sub=value' or '~key.sub'"
            )
        i += 1
    if config_file is None:
        raise ValueError("Missing '--config FILE.yaml' on the command line")
    return config_file, overrides


def _short(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _fill_subsection_names(cfg: DictConfig) -> None:
    """Missing or null experiment_name/trial_name/fileroot of a section default to the top-level ones."""
    for key in list(cfg.keys()):
        node = cfg._get_node(key)
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
            continue
        for name, ref in _SUBSECTION_DEFAULTS.items():
            if name not in node.keys():
                continue
            value_node = node._get_node(name)
            if OmegaConf.is_missing(node, name) or (
                value_node is not None and value_node._is_none()
            ):
                node[name] = ref


def describe_type(tp: Any) -> str:
    """Readable name of a field type: ``float | None`` -> ``'float | None'``, dataclasses by name."""
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe_type(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else describe_type(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else origin.__name__
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _field_type(config_cls: type, dotted: str) -> Any:
    """Declared type of ``a.b[0].c`` inside ``config_cls``, or None when it cannot be found."""
    tp: Any = config_cls
    for part in dotted.replace("]", "").replace("[", ".").split("."):
        if part.isdigit():
            tp = _list_item_dataclass(tp) or None
            if tp is None:
                return None
            continue
        cls = _dataclass_of(tp)
        if cls is None:
            return None
        tp = typing.get_type_hints(cls).get(part)
        if tp is None:
            return None
    return tp


def _type_error(config_cls: type, e: oc_errors.OmegaConfBaseException) -> ValueError:
    key = getattr(e, "full_key", None) or "?"
    tp = _field_type(config_cls, key)
    expected = describe_type(tp) if tp is not None else "the declared type"
    return ValueError(f"Config key '{key}' has the wrong type (expected {expected}): {_short(e)}")


def to_structured_cfg(cfg: Any, config_cls: type[ConfigT]) -> DictConfig:
    """Merge a plain/OmegaConf config over the defaults of ``config_cls`` (typed, validated keys)."""
    plain = (
        OmegaConf.to_container(cfg, resolve=False)
        if isinstance(cfg, (DictConfig, ListConfig))
        else cfg
    )
    _check_unknown_keys(plain or {}, config_cls, "")
    default_cfg = OmegaConf.structured(config_cls)
    try:
        merged = OmegaConf.merge(default_cfg, plain or {})
    except oc_errors.ValidationError as e:
        raise _type_error(config_cls, e) from None
    except (oc_errors.OmegaConfBaseException, TypeError) as e:
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(f"Config key '{key}': {_short(e)}") from None
    _fill_subsection_names(merged)
    return merged


def _to_object(cfg: DictConfig, config_cls: type[ConfigT]) -> ConfigT:
    try:
        obj = OmegaConf.to_object(cfg)
    except oc_errors.MissingMandatoryValue as e:
        raise ValueError(f"Required config key '{e.full_key}' is missing") from None
    except oc_errors.InterpolationResolutionError as e:
        raise ValueError(
            f"Config key '{e.full_key}': cannot resolve interpolation: {_short(e)}"
        ) from None
    except oc_errors.ValidationError as e:
        raise _type_error(config_cls, e) from None
    except oc_errors.OmegaConfBaseException as e:
        raise ValueError(f"Config key '{getattr(e, 'full_key', '?')}': {_short(e)}") from None
    if not isinstance(obj, config_cls):
        raise ValueError(f"Loaded config is a {type(obj).__name__}, expected {config_cls.__name__}")
    return obj


def build_config(yaml_dict: dict, overrides: list[str], config_cls: type[ConfigT]) -> ConfigT:
    """Typed config from a YAML mapping plus command-line overrides (no file I/O).

    Overrides (AReaL / Hydra forms): ``a.b=v`` and ``+a.b=v`` / ``++a.b=v`` set a key,
    list items by index (``actor.scheduling_spec.0.gpu=0``); ``~a.b`` removes a key from
    the YAML (its default applies). Values are parsed as YAML (``[1,2]``, ``{k: v}``,
    ``null``, ``'quoted'``); ``${x.y}`` interpolations stay. With
    ``cluster.n_gpus_per_node=0`` the CPU fallbacks of ``apply_cpu_fallbacks`` apply.
    """
    plain = copy.deepcopy(yaml_dict or {})
    if not isinstance(plain, dict):
        raise ValueError(
            f"The config must be a mapping at the top level, got {type(plain).__name__}"
        )
    plain = _migrate_legacy_sections(plain, config_cls)
    for item in overrides:
        _apply_override(plain, item, config_cls)
    plain = _migrate_legacy_sections(plain, config_cls)
    structured = to_structured_cfg(plain, config_cls)
    config = _to_object(structured, config_cls)
    apply_cpu_fallbacks(config)
    warn_not_acted_on(config)
    return config


def _parse_override_value(key: str, raw: str) -> Any:
    """A command-line value as YAML would read it; ``a=`` is the empty string."""
    if raw == "":
        return ""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    except oc_errors.OmegaConfBaseException as e:
        raise ValueError(f"Override '{key}={raw}': cannot parse the value: {_short(e)}") from None


def _schema_default(config_cls: type, parts: list[str]) -> Any:
    """Plain default value at ``parts`` inside ``config_cls`` (None when there is none)."""
    try:
        node = OmegaConf.select(OmegaConf.structured(config_cls), ".".join(parts))
    except oc_errors.OmegaConfBaseException:
        return None
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node


def _apply_override(plain: dict, item: str, config_cls: type) -> None:
    """Apply one override (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``) to ``plain``."""
    delete = item.startswith("~")
    key, sep, raw = item.lstrip("~+").partition("=")
    key = key.strip()
    if not key or (not sep and not delete):
        raise ValueError(
            f"Override {item!r}: expected 'key.sub=value', '+key.sub=value' or '~key.sub'"
        )
    parts = key.split(".")
    if any(not p for p in parts):
        raise ValueError(f"Override {item!r}: empty component in the key {key!r}")
    node: Any = plain
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, here, item)]
            continue
        child = node.get(part)
        if isinstance(child, str) and _is_interpolation(child):
            raise ValueError(
                f"Override {item!r}: '{here}' is the interpolation {child!r}; override what it "
                "points to, or give '{here}' a whole value"
            )
        if child is None or not isinstance(child, (dict, list)):
            default = _schema_default(config_cls, parts[: i + 1])
            child = default if isinstance(default, (dict, list)) else {}
            if delete and part not in node:
                return  # removing something that is not there
            node[part] = child
        node = child
    last = parts[-1]
    if isinstance(node, list):
        index = _list_index(node, last, key, item)
        if delete:
            node.pop(index)
        else:
            node[index] = _parse_override_value(key, raw)
        return
    if delete:
        node.pop(last, None)
    else:
        node[last] = _parse_override_value(key, raw)


def _list_index(node: list, part: str, here: str, item: str) -> int:
    if not part.isdigit():
        raise ValueError(f"Override {item!r}: '{here}' indexes a list; use a number, not {part!r}")
    index = int(part)
    if index >= len(node):
        raise ValueError(
            f"Override {item!r}: index {index} is out of range; the list has {len(node)} item(s)"
        )
    return index


def _rewrite_interpolations(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: _rewrite_interpolations(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_interpolations(v, old, new) for v in node]
    if isinstance(node, str) and "${" in node:
        return node.replace("${" + old + ".", "${" + new + ".").replace(
            "${" + old + "}", "${" + new + "}"
        )
    return node


def _migrate_legacy_sections(plain: dict, config_cls: type) -> dict:
    """Earlier section names -> current ones, with a warning.

    SFT / reward-model configs: ``model`` -> ``actor`` (interpolations ``${model.x}``
    follow). Keys under both names are merged, ``model``'s winning.
    """
    if not isinstance(plain, dict) or "model" not in plain:
        return plain
    names = {f.name for f in fields(config_cls)}
    if "actor" not in names or "model" in names:
        return plain
    plain = dict(plain)
    legacy = plain.pop("model")
    if "actor" in plain and isinstance(plain["actor"], dict) and isinstance(legacy, dict):
        legacy = OmegaConf.to_container(
            OmegaConf.merge(OmegaConf.create(plain["actor"]), OmegaConf.create(legacy)),
            resolve=False,
        )
    plain["actor"] = legacy
    plain = _rewrite_interpolations(plain, "model", "actor")
    _warn_once(
        f"model-section-{config_cls.__name__}",
        f"{config_cls.__name__}: the `model` section is deprecated; it was read as `actor` "
        "(as in AReaL). Rename it in the YAML.",
    )
    return plain


def get_log_path(config: Any) -> str:
    """``{cluster.fileroot}/logs/{experiment_name}/{trial_name}``: logs and config.yaml live here."""
    return os.path.join(config.cluster.fileroot, "logs", config.experiment_name, config.trial_name)


def conf_as_dict(cfg: Any) -> dict:
    """Plain dict of a dataclass config or an OmegaConf node (interpolations resolved)."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return asdict(cfg)


def save_config(cfg: Any, log_dir: str) -> str:
    """Write ``cfg`` as ``log_dir/config.yaml`` (directories created); returns the file path."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(conf_as_dict(cfg), f, default_flow_style=False, sort_keys=False)
    return path


def load_expr_config(argv: list[str], config_cls: type[ConfigT]) -> tuple[ConfigT, str]:
    """Load ``--config FILE.yaml`` plus overrides into ``config_cls``.

    Returns ``(config, absolute path of the YAML file)``. Overrides are ``a.b=value``;
    ``+a.b=value`` (Hydra's form for keys absent from the YAML) is accepted as well.
    Sub-sections whose experiment_name / trial_name / fileroot are not given inherit
    the top-level values. Errors (unknown key, wrong type, invalid value, missing
    required key) are ValueErrors naming the dotted key. On rank 0 (env RANK unset or
    0) the resolved config is written to ``get_log_path(config)/config.yaml``.
    """
    config_file, overrides = _split_argv(list(argv))
    path = Path(config_file).absolute()
    if not path.is_file():
        raise ValueError(f"Config file {str(path)!r} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # yaml errors come in several classes
        raise ValueError(f"Cannot parse YAML file {str(path)!r}: {_short(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"Config file {str(path)!r} must contain a mapping at the top level")
    config = build_config(OmegaConf.to_container(loaded, resolve=False), overrides, config_cls)
    if os.environ.get("RANK", "0") == "0":
        saved = save_config(config, get_log_path(config))
        logger.info(f"Resolved config written to {saved}")
    return config, str(path)
