"""Megatron-LM backend sections: ``MegatronEngineConfig`` with its ``DistributedDataParallelConfig``
and ``FP8EngineConfig``.

This project has no Megatron engine: a ``megatron:`` backend runs on the parallel engine
(Archon) with the same d/t/p/c/e dimensions, and the settings here are accepted so that
AReaL YAMLs load, with a warning naming them when they differ from the defaults
("accepted but not acted on"). Re-exported by ``areal.api.cli_args``.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.api.config_common import cfield


@dataclass
class FP8EngineConfig:
    """FP8 training options of the Megatron backend. This project accepts it so AReaL YAMLs load, but does not act on it (no Megatron / FP8 hardware)."""

    mode: str = cfield("e4m3", "'e4m3' or 'hybrid' (e5m2 for output-activation gradients).")
    recipe: str = cfield(
        "delayed", "Scaling recipe: 'tensorwise', 'delayed', 'mxfp8', 'blockwise'."
    )
    param: bool = cfield(False, "Keep parameters in FP8.")
    margin: int = cfield(0, "Margin of the scaling-factor computation.")
    amax_history_len: int = cfield(1, "Length of the amax history window.")
    amax_compute_algo: str = cfield("most_recent", "'max' or 'most_recent'.")
    wgrad: bool = cfield(True, "FP8 weight gradients (False: higher precision).")
    dot_product_attention: bool = cfield(False, "FP8 dot-product attention.")
    multi_head_attention: bool = cfield(False, "FP8 multi-head attention.")
    tp_only_amax_red: bool = cfield(False, "Reduce amax only in the TP (or TP-CP) domain.")
    first_last_layers_bf16: bool = cfield(False, "Keep the first/last blocks in BF16.")
    num_layers_at_start_in_bf16: int = cfield(1, "Leading blocks kept in BF16.")
    num_layers_at_end_in_bf16: int = cfield(1, "Trailing blocks kept in BF16.")
    direct_convert: bool = cfield(True, "Convert FP8 parameters directly on weight update/save.")


@dataclass
class DistributedDataParallelConfig:
    """Megatron DistributedDataParallel options. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    grad_reduce_in_fp32: bool = cfield(True, "Reduce gradients in fp32.")
    overlap_grad_reduce: bool = cfield(False, "Overlap gradient reduction with backward.")
    overlap_param_gather: bool = cfield(False, "Overlap parameter all-gather with forward.")
    align_param_gather: bool = cfield(False, "Align parameter all-gathers across pipeline stages.")
    use_distributed_optimizer: bool = cfield(
        True, "Shard optimizer states across data-parallel ranks."
    )
    check_for_nan_in_grad: bool = cfield(False, "Check gradients for NaN after reduction.")
    bucket_size: int | None = cfield(
        None, "Gradient bucket size in elements; None for the default."
    )
    average_in_collective: bool = cfield(False, "Average (not sum) inside the collective.")
    fp8_param_gather: bool = cfield(False, "All-gather parameters in fp8.")


@dataclass
class MegatronEngineConfig:
    """Megatron-LM training backend options. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    wrap_with_ddp: bool = cfield(True, "Wrap the model with Megatron DDP.")
    use_torch_fsdp2: bool = cfield(False, "Use torch FSDP2 inside Megatron.")
    use_custom_fsdp: bool = cfield(False, "Use Megatron's custom FSDP.")
    ddp: DistributedDataParallelConfig = cfield(
        help="Megatron DDP options.", factory=DistributedDataParallelConfig
    )
    virtual_pipeline_parallel_size: int = cfield(1, "Virtual pipeline stages per rank (1 = off).")
    overlap_param_gather_with_optimizer_step: bool = cfield(
        False, "Overlap parameter gather with the optimizer step."
    )
    use_precision_aware_optimizer: bool = cfield(False, "Precision-aware optimizer.")
    main_grads_dtype: str = cfield("float32", "Dtype of main gradients.")
    main_params_dtype: str = cfield("float32", "Dtype of main parameters.")
    exp_avg_dtype: str = cfield("float32", "Dtype of Adam first moments.")
    exp_avg_sq_dtype: str = cfield("float32", "Dtype of Adam second moments.")
    async_save: bool = cfield(False, "Save checkpoints asynchronously.")
    use_checkpoint_opt_param_scheduler: bool = cfield(
        True, "Restore the LR scheduler from the checkpoint."
    )
    use_deterministic_algorithms: bool = cfield(False, "Force deterministic kernels.")
    recompute_granularity: str | None = cfield("full", "Activation recomputation granularity.")
    recompute_method: str | None = cfield("uniform", "Activation recomputation method.")
    recompute_num_layers: int | None = cfield(1, "Layers per recomputation unit.")
    distribute_saved_activations: bool | None = cfield(
        None, "Distribute saved activations over TP."
    )
    recompute_modules: list[str] | None = cfield(None, "Modules to recompute.")
    moe_router_dtype: str | None = cfield("fp32", "Dtype of the MoE router computation.")
    moe_shared_expert_overlap: bool = cfield(False, "Overlap shared experts with dispatch.")
    moe_enable_deepep: bool = cfield(False, "Use DeepEP for MoE dispatch.")
    moe_token_dispatcher_type: str = cfield("alltoall", "MoE token dispatcher type.")
    moe_permute_fusion: bool = cfield(False, "Fuse MoE token permutation.")
    fp8_config: FP8EngineConfig | None = cfield(None, "FP8 training options.")
    bridge_type: str = cfield("mbridge", "HF <-> Megatron bridge: 'mbridge' or 'megatron-bridge'.")
    use_mbridge_save: bool = cfield(False, "Save weights with mbridge (less GPU memory).")
    moe_router_fusion: bool = cfield(False, "Fuse MoE top-k routing and aux-loss computation.")
    moe_router_bias_update_rate: float = cfield(
        0.0, "Update rate of the aux-loss-free MoE expert bias (DeepSeek-V3 style); 0: off."
    )
    moe_z_loss_coeff: float | None = cfield(None, "Router z-loss coefficient; None: off.")
    enable_chunked_logits: bool = cfield(
        False, "AReaL's CUDA-only chunked-logits LM head (vocab-parallel)."
    )
    entropy_requires_grad: bool = cfield(False, "Keep entropy gradients in the LM-head path.")
    lm_head_loss_chunk_size: int = cfield(
        0, "Sequence chunk size of the chunked LM-head loss; 0: not chunked."
    )
    enable_fp32_lm_head: bool = cfield(False, "Compute the LM-head projection in fp32.")
    cross_entropy_loss_fusion: bool = cfield(False, "Fused cross-entropy kernel.")
    use_bridge_for_update_weights: bool = cfield(
        False, "Weight sync through megatron-bridge's HF export."
    )
    disable_grad_buffers_cpu_backup: bool = cfield(
        False, "No CPU backup of gradient buffers when offloading (torch_memory_saver)."
    )
    enable_mtp: bool = cfield(False, "Keep the model's multi-token-prediction head.")
