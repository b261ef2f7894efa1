"""Training-engine configs: micro-batching, normalisation, optimizer, FSDP (and the accepted Megatron / Archon / FP8 sections), worker scheduling, ``TrainEngineConfig``.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum

from omegaconf import MISSING

from areal.api.config_common import NOT_ACTED, cfield, check_choice, check_range, warn_once
from areal.api.megatron_config import MegatronEngineConfig

_NORM_LEVELS = ["batch", "group", None]


PACKING_ALGORITHMS = ["ffd", "kk"]


@dataclass
class NormConfig:
    """Reward or advantage normalisation: subtract a mean, divide by a standard deviation."""

    mean_level: str | None = cfield(
        "batch",
        "Over which samples the mean is taken: 'batch' (whole batch), 'group' (the samples "
        "of one prompt), or None / 'none' (no mean subtraction).",
        choices=_NORM_LEVELS,
    )
    mean_leave1out: bool = cfield(
        False, "Leave-one-out mean: each sample's baseline excludes the sample itself (RLOO)."
    )
    std_level: str | None = cfield(
        "batch",
        "Over which samples the standard deviation is taken: 'batch', 'group', or "
        "None / 'none' (no division).",
        choices=_NORM_LEVELS,
    )
    std_unbiased: bool = cfield(True, "Use the unbiased (n-1) standard deviation estimator.")
    eps: float = cfield(1e-5, "Added to the standard deviation before dividing; > 0.")
    group_size: int = cfield(
        1,
        "Samples per group for group-level statistics (usually gconfig.n_samples); >= 1. "
        "Trainer rollouts tag rows with group and episode ids, which then define the groups "
        "(an agent episode exported one row per call counts once).",
    )

    def __post_init__(self):
        owner = "NormConfig"
        if isinstance(self.mean_level, str) and self.mean_level.lower() == "none":
            self.mean_level = None
        if isinstance(self.std_level, str) and self.std_level.lower() == "none":
            self.std_level = None
        check_choice(owner, "mean_level", self.mean_level, ["batch", "group", "none", None])
        check_choice(owner, "std_level", self.std_level, ["batch", "group", "none", None])
        check_range(owner, "eps", self.eps, gt=0)
        check_range(owner, "group_size", self.group_size, ge=1)


@dataclass
class MicroBatchSpec:
    """How one (mini-)batch is split into micro-batches for forward/backward passes.

    With ``max_tokens_per_mb`` set, sequences are packed into micro-batches of at most
    that many tokens (``packing_algorithm``: first-fit decreasing or Karmarkar-Karp),
    and ``n_mbs`` is the minimum number of micro-batches.
    """

    n_mbs: int | None = cfield(
        1,
        "Number of micro-batches; the minimum number when max_tokens_per_mb is set; >= 1.",
    )
    granularity: int = cfield(
        1,
        "Adjacent sequences are kept together in groups of this size when splitting "
        "(e.g. the samples of one prompt); >= 1.",
    )
    max_tokens_per_mb: int | None = cfield(
        None,
        "Token budget of one micro-batch. None: split by n_mbs only.",
    )
    n_mbs_divisor: int = cfield(
        1,
        "The number of micro-batches is rounded up to a multiple of this value "
        "(e.g. the pipeline-parallel size); >= 1.",
    )
    packing_algorithm: str = cfield(
        "ffd",
        "How sequences are assigned to micro-batches (and to data-parallel ranks): 'ffd' "
        "(first-fit decreasing) or 'kk' (Karmarkar-Karp balanced partitioning: more even "
        "token counts, slightly slower).",
        choices=PACKING_ALGORITHMS,
    )

    def __post_init__(self):
        owner = "MicroBatchSpec"
        check_choice(owner, "packing_algorithm", self.packing_algorithm, PACKING_ALGORITHMS)
        check_range(owner, "n_mbs", self.n_mbs, ge=1, optional=True)
        check_range(owner, "granularity", self.granularity, ge=1)
        check_range(owner, "max_tokens_per_mb", self.max_tokens_per_mb, ge=1, optional=True)
        check_range(owner, "n_mbs_divisor", self.n_mbs_divisor, ge=1)

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


_DTYPES = ["float32", "bfloat16", "float16"]


_ATTN_IMPLS = ["flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention"]


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule of a trained model."""

    type: str = cfield(
        "adam",
        "Optimizer: 'adam' (AdamW), 'sgd', or 'adam_bf16' (AdamW with bf16 states; GPU only).",
        choices=["adam", "sgd", "adam_bf16"],
    )
    lr: float = cfield(1e-3, "Peak learning rate; >= 0.")
    weight_decay: float = cfield(0.01, "Decoupled weight decay; >= 0.")
    beta1: float = cfield(0.9, "Adam beta1 (first-moment decay), in [0, 1).")
    beta2: float = cfield(0.999, "Adam beta2 (second-moment decay), in [0, 1).")
    eps: float = cfield(1e-8, "Adam epsilon; > 0.")
    min_lr_ratio: float = cfield(
        0.0, "Final learning rate as a fraction of lr for the linear/cosine schedules, in [0, 1]."
    )
    lr_scheduler_type: str = cfield(
        "constant",
        "Learning-rate schedule after warm-up: 'constant', 'linear' or 'cosine' decay.",
        choices=["constant", "linear", "cosine"],
    )
    warmup_steps_proportion: float = cfield(
        0.001,
        "Fraction of all training steps spent in linear warm-up, in [0, 1]; ignored when "
        "warmup_steps is set.",
    )
    warmup_steps: int | None = cfield(
        None,
        "Linear warm-up length in optimizer steps (>= 0); takes precedence over "
        "warmup_steps_proportion (a warning when both are set). None: use the proportion.",
    )
    gradient_clipping: float = cfield(1.0, "Clip the global gradient norm to this value; > 0.")
    offload: bool = cfield(False, "Keep optimizer states in CPU memory (GPU runs only).")
    initial_loss_scale: float = cfield(2**32, "Initial fp16 loss scale. " + NOT_ACTED)
    min_loss_scale: float = cfield(1.0, "Minimum fp16 loss scale. " + NOT_ACTED)
    loss_scale_window: float = cfield(5, "Steps between fp16 loss-scale increases. " + NOT_ACTED)
    hysteresis: int = cfield(2, "fp16 loss-scale hysteresis. " + NOT_ACTED)

    def __post_init__(self):
        owner = "OptimizerConfig"
        check_choice(owner, "type", self.type, ["adam", "sgd", "adam_bf16"])
        check_choice(
            owner, "lr_scheduler_type", self.lr_scheduler_type, ["constant", "linear", "cosine"]
        )
        check_range(owner, "lr", self.lr, ge=0)
        check_range(owner, "weight_decay", self.weight_decay, ge=0)
        check_range(owner, "beta1", self.beta1, ge=0, lt=1)
        check_range(owner, "beta2", self.beta2, ge=0, lt=1)
        check_range(owner, "eps", self.eps, gt=0)
        check_range(owner, "min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        check_range(owner, "warmup_steps_proportion", self.warmup_steps_proportion, ge=0, le=1)
        check_range(owner, "warmup_steps", self.warmup_steps, ge=0, optional=True)
        if self.warmup_steps is not None and self.warmup_steps_proportion != 0.001:
            warn_once(
                "warmup-steps-both",
                f"{owner}: both warmup_steps={self.warmup_steps} and warmup_steps_proportion="
                f"{self.warmup_steps_proportion} are set; warmup_steps is used",
            )
        check_range(owner, "gradient_clipping", self.gradient_clipping, gt=0)

    def warmup_length(self, total_steps: int) -> int:
        """Warm-up optimizer steps of a run of ``total_steps`` steps."""
        if self.warmup_steps is not None:
            return int(self.warmup_steps)
        return int(self.warmup_steps_proportion * total_steps)


@dataclass
class FSDPWrapPolicy:
    """Which modules FSDP shards as separate units."""

    transformer_layer_cls_to_wrap: list[str] | None = cfield(
        None,
        "Class names of the layers to shard separately. None: the model's decoder layers "
        "(transformers' _no_split_modules).",
    )


@dataclass
class FSDPEngineConfig:
    """Options of the FSDP2 training backend."""

    wrap_policy: FSDPWrapPolicy | None = cfield(
        None, "Sharding-unit policy; None uses the default."
    )
    offload_params: bool = cfield(False, "Keep sharded parameters in CPU memory (GPU runs only).")
    memory_efficient_load: bool = cfield(
        False, "Load pretrained weights on rank 0 only and broadcast after sharding. " + NOT_ACTED
    )
    per_layer_optim_step: bool = cfield(False, "Layer-by-layer optimizer step on GPU. " + NOT_ACTED)
    optim_step_prefetch_layers: int = cfield(
        1, "Layers prefetched by per_layer_optim_step. " + NOT_ACTED
    )
    shard_vision_across_sp: bool = cfield(
        False, "Shard a vision encoder across sequence-parallel ranks. " + NOT_ACTED
    )


@dataclass
class ArchonFP8Config:
    """FP8 options of the Archon backend. FP8 kernels are not implemented here: with an
    ``archon`` backend any other mode trains in the engine's dtype, with a warning
    (``ArchonEngineConfig.substitutions``)."""

    mode: str = cfield(
        "disabled",
        "'disabled' or 'blockwise' (128x128 FP8 matmuls, Hopper GPUs).",
        choices=["disabled", "blockwise"],
    )
    exclude_modules: list[str] = cfield(
        help="Name substrings of linear layers kept in BF16.",
        factory=lambda: ["output", "router", "score"],
    )
    include_experts: bool = cfield(False, "FP8 for MoE experts too.")
    use_triton: bool = cfield(True, "Triton GEMM kernels for blockwise FP8.")

    def __post_init__(self):
        check_choice("ArchonFP8Config", "mode", self.mode, ["disabled", "blockwise"])


@dataclass
class ArchonEngineConfig:
    """Archon training backend options (``backend='archon:...'``, ``areal.engine.archon``).

    With an ``archon`` backend every field is acted on or, set to a value this engine
    does not support, refused by name when the config is parsed (``refusals``): FP8,
    parameter offload, torch.compile, tree attention, ZeroBubble pipeline schedules,
    op-level selective and memory-budget activation checkpointing, AC debugging."""

    attn_type: str = cfield(
        "varlen", "'varlen', 'sdpa' or 'tree'.", choices=["varlen", "sdpa", "tree"]
    )
    offload_params: bool = cfield(False, "Offload FSDP parameters to CPU.")
    enable_compile: bool = cfield(
        False, "torch.compile the transformer blocks (here: runs eagerly, with a warning)."
    )
    ac_mode: str = cfield(
        "selective",
        "Activation checkpointing: 'none', 'full', 'selective', 'memory_budget'.",
        choices=["none", "full", "selective", "memory_budget"],
    )
    selective_ac_option: str = cfield(
        "op", "'op' (here: every block recomputed, with a warning) or every N-th layer ('2')."
    )
    ac_memory_budget: float = cfield(0.5, "Memory budget of 'memory_budget' checkpointing.")
    ac_preserve_rng_state: bool = cfield(False, "Preserve the RNG state in checkpointing.")
    ac_debug: bool = cfield(False, "Capture checkpointing debug information.")
    pp_schedule: str = cfield(
        "Interleaved1F1B",
        "Pipeline schedule (torch.distributed.pipelining): 'GPipe', '1F1B' (one stage per "
        "rank) or 'Interleaved1F1B' (virtual stages s, s+p, ... per rank; two per rank "
        "unless pp_layers_per_stage says otherwise). ZeroBubble schedules are refused.",
        choices=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
    )
    pp_layers_per_stage: int | None = cfield(
        None,
        "Layers per (virtual) pipeline stage, counting the embedding and the head as "
        "pp_first/last_stage_less_layers layers; fixes the number of stages "
        "(None: p stages, 2p for Interleaved1F1B).",
    )
    pp_first_stage_less_layers: int = cfield(
        1, "The first stage gets this many fewer decoder layers (it holds the embedding)."
    )
    pp_last_stage_less_layers: int = cfield(
        1, "The last stage gets this many fewer decoder layers (it holds the output head)."
    )
    reshard_after_forward_policy: str = cfield(
        "default", "'default', 'always' or 'never'.", choices=["default", "always", "never"]
    )
    fp8_config: ArchonFP8Config = cfield(help="FP8 training.", factory=ArchonFP8Config)
    use_deterministic_algorithms: bool = cfield(False, "Deterministic kernels.")
    moe_router_dtype: str | None = cfield(
        "fp32", "Dtype of the MoE router GEMM ('fp32' or None).", choices=["fp32", None]
    )
    router_replay: bool = cfield(
        False,
        "MoE routing replay: the forward routes each token to the experts in the batch's "
        "'routed_experts' ([batch, seq, n_moe_layers, top_k], the inference server's "
        "return_routed_experts) instead of the router's top-k, so the policy ratio compares "
        "the same experts.",
    )

    def __post_init__(self):
        check_choice(
            "ArchonEngineConfig",
            "pp_schedule",
            self.pp_schedule,
            ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
        )
        for name in ("pp_first_stage_less_layers", "pp_last_stage_less_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"ArchonEngineConfig.{name}={getattr(self, name)}: must be >= 0")
        if self.pp_layers_per_stage is not None and self.pp_layers_per_stage < 1:
            raise ValueError(
                f"ArchonEngineConfig.pp_layers_per_stage={self.pp_layers_per_stage}: "
                "must be None or >= 1"
            )

    def substitutions(self, gradient_checkpointing: bool = False) -> list[tuple[str, str]]:
        """``(field, message)`` of the settings AReaL's archon engine runs and this one runs
        another way (AReaL 2.0 YAMLs set them): torch.compile -> eager (the same results,
        slower), op-level selective checkpointing -> recomputing every block (the same
        gradients, more recompute), FP8 -> the engine's own dtype (no FP8 kernels here:
        more precise, slower). ``adopt_substitutes`` applies them."""
        out = []
        if self.enable_compile:
            out.append(
                ("enable_compile", "archon.enable_compile=True: runs eagerly (torch.compile is "
                 "not used by this engine; the same results, slower)")
            )  # fmt: skip
        if (
            gradient_checkpointing
            and self.ac_mode == "selective"
            and not str(self.selective_ac_option).isdigit()
        ):
            out.append(
                ("ac_mode", f"archon.selective_ac_option={self.selective_ac_option!r}: "
                 "recomputes every block (ac_mode='full'; op-level selective checkpointing is "
                 "not implemented: the same gradients, more recompute)")
            )  # fmt: skip
        if self.fp8_config.mode != "disabled":
            out.append(
                ("fp8_config", f"archon.fp8_config.mode={self.fp8_config.mode!r}: trains in "
                 "the engine's dtype (actor.dtype; FP8 kernels are not implemented here)")
            )  # fmt: skip
        return out

    def adopt_substitutes(self, owner: str, gradient_checkpointing: bool = False) -> None:
        """Apply ``substitutions``, each with a warning (once per process) naming ``owner``."""
        from areal.api.config_common import warn_once

        for name, message in self.substitutions(gradient_checkpointing):
            warn_once(f"archon-substitute:{owner}:{name}", f"{owner}: {message}")
            if name == "enable_compile":
                self.enable_compile = False
            elif name == "ac_mode":
                self.ac_mode = "full"
            elif name == "fp8_config":
                self.fp8_config.mode = "disabled"

    def refusals(self, gradient_checkpointing: bool = False) -> list[str]:
        """One line per field set to a value the archon engine here does not support (after
        ``adopt_substitutes``)."""
        out = []
        if self.offload_params:
            out.append("archon.offload_params=True: parameter offload is not supported; use False")
        if self.attn_type == "tree":
            out.append(
                "archon.attn_type='tree': tree attention is not supported; allowed: 'varlen', 'sdpa'"
            )
        if "ZeroBubble" in self.pp_schedule:
            out.append(
                f"archon.pp_schedule={self.pp_schedule!r}: ZeroBubble schedules are not "
                "supported; allowed: 'GPipe', '1F1B', 'Interleaved1F1B'"
            )
        if self.ac_debug:
            out.append(
                "archon.ac_debug=True: activation-checkpointing debug capture is not supported; use False"
            )
        if gradient_checkpointing and self.ac_mode != "none" and self.router_replay:
            # a block recomputed in backward would route by the router's own top-k (the
            # replayed ids are cleared after the forward): wrong gradients, so refused
            out.append(
                "archon.router_replay=True with gradient_checkpointing=True: the recomputed "
                "blocks would not replay the routing; allowed: one of them, or "
                "archon.ac_mode='none'"
            )
        if gradient_checkpointing and self.ac_mode == "memory_budget":
            out.append(
                "archon.ac_mode='memory_budget' needs torch.compile, which is not supported; "
                "allowed: 'none', 'full', 'selective' with selective_ac_option an integer"
            )
        return out

    def adopt_mapped_layout(self) -> None:
        """A 'megatron:' / model-parallel 'fsdp:' layout runs on archon: its YAML's
        gradient_checkpointing means recomputing every block (op-level selective
        checkpointing, archon's default, is not supported here), so the untouched default
        becomes ac_mode='full'."""
        if self.ac_mode == "selective" and self.selective_ac_option == "op":
            self.ac_mode = "full"

    def refuse_unsupported(self, owner: str, gradient_checkpointing: bool = False) -> None:
        """Adopt the substitutes (``adopt_substitutes``), then raise ``ValueError`` naming
        every unsupported field (see ``refusals``)."""
        self.adopt_substitutes(owner, gradient_checkpointing)
        found = self.refusals(gradient_checkpointing)
        if found:
            raise ValueError(f"{owner} with an archon backend: " + "; ".join(found))


class SchedulingStrategyType(StrEnum):
    """Values of ``SchedulingStrategy.type``."""

    separation = "separation"
    colocation = "colocation"


@dataclass
class SchedulingStrategy:
    """Whether a role gets its own workers or shares another role's workers."""

    type: str = cfield(
        "separation",
        "'separation': own workers; 'colocation': share the workers of `target`.",
        choices=["separation", "colocation"],
    )
    target: str | None = cfield(
        None, "Role to colocate with (e.g. 'actor'); required for colocation."
    )
    fork: bool = cfield(
        True,
        "With colocation, start a separate process on the target's devices instead of sharing it.",
    )

    def __post_init__(self):
        check_choice("SchedulingStrategy", "type", self.type, ["separation", "colocation"])
        if self.type == "colocation" and not self.target:
            raise ValueError(
                "SchedulingStrategy.target is empty; 'colocation' needs the role to colocate with, e.g. 'actor'"
            )


@dataclass
class SchedulingSpec:
    """Resources and launch command of one kind of worker process."""

    cpu: int = cfield(8, "CPU cores per worker; >= 0.")
    gpu: int = cfield(0, "GPUs per worker; >= 0 (0 on CPU machines).")
    mem: int = cfield(32, "Memory per worker in GB; >= 0.")
    port_count: int = cfield(2, "Network ports reserved per worker; >= 0.")
    image: str = cfield(
        "/storage/openpsi/images/areal-latest.sif",
        "Container image (Slurm with apptainer only).",
    )
    task_type: str = cfield(
        "worker", "'worker' (RPC worker process) or 'engine'.", choices=["worker", "engine"]
    )
    env_vars: dict[str, str] = cfield(
        help="Extra environment variables of the worker.", factory=dict
    )
    cmd: str | None = cfield(
        None, "Command that starts the worker; None for the project's RPC worker."
    )
    srun_additional_args: str = cfield(
        "--unbuffered --mpi=pmi2 -K --chdir $PWD", "Extra `srun` arguments (Slurm only)."
    )
    additional_bash_cmds: list[str] | None = cfield(
        None, "Shell commands run before the worker starts (Slurm only)."
    )
    container_type: str = cfield(
        "apptainer",
        "Container runtime on Slurm: 'apptainer' or 'none'.",
        choices=["apptainer", "none"],
    )
    mount: str = cfield("/storage:/storage", "Bind mount for the container (Slurm only).")
    nodelist: str | None = cfield(
        None,
        "Nodes to run on. Slurm: `--nodelist` for sbatch/srun. Ray: comma-separated node "
        "IPs or hostnames; worker i goes to node i mod n of the list.",
    )
    exclude: str | None = cfield(
        None, "`--exclude` for sbatch/srun (Slurm only; the Ray scheduler refuses it)."
    )
    reservation: str | None = cfield(
        None, "`--reservation` for sbatch (Slurm only): run the jobs in this reservation."
    )
    exclusive: bool = cfield(
        False, "`--exclusive` for sbatch (Slurm only): nodes are not shared with other jobs."
    )
    ray_placement_strategy: str = cfield(
        "shared",
        "Ray placement groups: 'shared' (one for the role), 'separate' (one per worker), "
        "'deferred' (like separate, accelerators assigned later).",
        choices=["shared", "separate", "deferred"],
    )

    def __post_init__(self):
        owner = "SchedulingSpec"
        for name in ("cpu", "gpu", "mem", "port_count"):
            check_range(owner, name, getattr(self, name), ge=0)
        check_choice(owner, "task_type", self.task_type, ["worker", "engine"])
        check_choice(owner, "container_type", self.container_type, ["apptainer", "none"])
        check_choice(
            owner,
            "ray_placement_strategy",
            self.ray_placement_strategy,
            ["shared", "separate", "deferred"],
        )


def default_scheduling_spec() -> list[SchedulingSpec]:
    return [SchedulingSpec(cpu=1, mem=4)]


@dataclass
class TrainEngineConfig:
    """A trained (or forward-only) model: where it comes from, precision, optimizer, backend."""

    experiment_name: str = cfield(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = cfield(MISSING, "Trial name; defaults to the top-level trial_name.")
    path: str = cfield(
        "",
        "HuggingFace checkpoint directory or hub name of the model (config + weights; only "
        "the config when init_from_scratch).",
    )
    init_from_scratch: bool = cfield(
        False, "Randomly initialise the weights instead of loading them."
    )
    dtype: str = cfield(
        "bfloat16", "Parameter dtype: 'float32', 'bfloat16' or 'float16'.", choices=_DTYPES
    )
    optimizer: OptimizerConfig | None = cfield(
        None, "Optimizer; None means the model is not trained (e.g. the reference model)."
    )
    mb_spec: MicroBatchSpec = cfield(
        help="Micro-batch split of each forward/backward pass.", factory=MicroBatchSpec
    )
    backend: str = cfield(
        "",
        "Training backend and parallel sizes, e.g. 'fsdp:d2'. Empty: taken from the "
        "top-level allocation_mode.",
    )
    attn_impl: str = cfield(
        "flash_attention_2",
        "transformers attention implementation. On CPU the engines use 'sdpa' instead of "
        "flash attention.",
        choices=_ATTN_IMPLS,
    )
    gradient_checkpointing: bool = cfield(
        False, "Recompute activations in backward to save memory."
    )
    disable_dropout: bool = cfield(False, "Set every dropout probability to 0.")
    freeze_vision_tower: bool = cfield(
        False,
        "Vision-language models (Qwen2-VL family): keep the vision tower (patch embedding, "
        "vision blocks, merger) fixed: no gradients, not in the optimizer. The language "
        "model always trains.",
    )
    temperature: float = cfield(
        1.0, "Sampling temperature the logits are divided by when computing logprobs; > 0."
    )
    weight_update_mode: str = cfield(
        "xccl",
        "How new weights reach the inference servers: 'xccl' (collective broadcast: NCCL "
        "on GPU, gloo on CPU) or 'disk' (safetensors + reload). 'awex' (AReaL 2.0's "
        "Megatron + SGLang transfer engine) runs as 'xccl' here, with a warning.",
        choices=["disk", "xccl", "awex"],
    )
    weight_update_timeout: float = cfield(
        120.0,
        "xccl only (this project's addition): seconds that the weight-update group join and "
        "each broadcast may wait for the other side (trainer and inference servers) before "
        "failing with an error; > 0.",
    )
    num_threads: int = cfield(
        1,
        "CPU only (this project's addition): torch intra-op threads per training worker; >= 1. "
        "One thread per process is fastest when processes share few cores.",
    )
    is_critic: bool = cfield(False, "The model has a scalar value head (critic or reward model).")
    pad_to_maximum: bool = cfield(
        False,
        "With enable_tree_training: pad every trie to mb_spec.max_tokens_per_mb rows "
        "(steadier memory, slower; padding rows attend to themselves only).",
    )
    grad_reduce_dtype: str = cfield("float32", "Dtype of gradient reduction.", choices=_DTYPES)
    cpu_compute_dtype: str = cfield(
        "float32",
        "Compute dtype of training on CPU (`dtype` applies on GPUs): 'float32'; 'bfloat16' "
        "(bf16 forward/backward under FSDP2 mixed precision, fp32 master weights, optimizer "
        "states and log-probabilities; fast only on CPUs with AVX-512-BF16 or AMX-BF16); "
        "'auto' (bfloat16 where the CPU has those instructions, else float32).",
        choices=["float32", "bfloat16", "auto"],
    )
    scheduling_spec: list[SchedulingSpec] = cfield(
        help="Worker resources: one spec (engine inside the worker) or two (worker, engine). "
        "Used by the single-controller schedulers.",
        factory=default_scheduling_spec,
    )
    scheduling_strategy: SchedulingStrategy = cfield(
        help="Own workers ('separation') or another role's ('colocation').",
        factory=SchedulingStrategy,
    )
    fsdp: FSDPEngineConfig = cfield(help="FSDP2 backend options.", factory=FSDPEngineConfig)
    megatron: MegatronEngineConfig = cfield(
        help="Megatron backend options. " + NOT_ACTED, factory=MegatronEngineConfig
    )
    archon: ArchonEngineConfig = cfield(
        help="Archon backend options (used with backend 'archon:...'; unsupported values "
        "are refused by name).",
        factory=ArchonEngineConfig,
    )
    offload: bool = cfield(
        False, "Offload parameters and optimizer states to CPU between uses (GPU). " + NOT_ACTED
    )
    use_kernels: bool = cfield(False, "Apply HuggingFace `kernels` to the model. " + NOT_ACTED)
    use_lora: bool = cfield(
        False,
        "Train LoRA adapters (peft) instead of all weights; with weight_update_mode 'disk' "
        "the weight sync sends only the adapter.",
    )
    lora_rank: int = cfield(32, "LoRA rank r; >= 1.")
    lora_alpha: int = cfield(16, "LoRA alpha (the update is scaled by lora_alpha / lora_rank).")
    target_modules: list[str] = cfield(
        help="Module names LoRA adapts (e.g. q_proj, v_proj); empty or ['all-linear']: every "
        "attention and MLP projection.",
        factory=list,
    )
    peft_type: str = cfield("lora", "PEFT method. " + NOT_ACTED)
    enable_tree_training: bool = cfield(
        False,
        "Tree training (FSDP engine, actors): each micro-batch's sequences packed as one "
        "prefix trie, every shared token computed once, attention restricted to each "
        "token's ancestors (exact); mb_spec.max_tokens_per_mb counts the stored trie tokens. "
        "Pays off when rows repeat each other's prefixes at several depths (agent exports "
        "with one row per call); a micro-batch shared one level deep (GRPO groups, DPO/RW "
        "pairs) runs the default shared-prefix layout, which already stores it once.",
    )
    _version: str = cfield(
        "v1",
        "AReaL's train-controller version: 'v1' (this project's controller) or 'v2' (AReaL's "
        "gateway controller). " + NOT_ACTED,
        choices=["v1", "v2"],
    )
    admin_api_key: str = cfield("areal-admin-key", "Gateway admin key (v2). " + NOT_ACTED)
    log_level: str = cfield("warning", "Gateway log level (v2). " + NOT_ACTED)
    request_timeout: float = cfield(3600.0, "Gateway request timeout in seconds (v2). " + NOT_ACTED)
    setup_timeout: float = cfield(3600.0, "Gateway setup timeout in seconds (v2). " + NOT_ACTED)
    logprobs_chunk_size: int = cfield(
        1024,
        "Largest sequence chunk over which log-probabilities and entropy are computed at "
        "once; > 0. " + NOT_ACTED,
    )
    optimizer_dtype: str = cfield(
        "float32",
        "Dtype of the master parameters and optimizer states: 'float32' (this project "
        "always keeps fp32 master weights) or 'bfloat16' (AReaL 2.0: bf16 storage). " + NOT_ACTED,
        choices=["float32", "bfloat16"],
    )
    enable_delta_weight_update: bool = cfield(
        False,
        "Send only the weights that changed since the servers' committed version: the "
        "trainer keeps a copy of that version in the servers' dtype (rank 0, CPU) and "
        "writes the elements that differ from it (flat indices + values; a tensor whose "
        "sparse form would not be smaller goes whole), which built-in servers apply as a "
        "pending update (commit, rollback and verified weight sync as for a full one). A "
        "full sync is sent first, every weight_update_anchor_interval deltas, after a "
        "rolled-back delta, and always for vLLM/SGLang servers (no delta route, logged "
        "once). Only with weight_update_mode='disk' (with 'xccl' the full broadcast is "
        "used, logged once) and without LoRA. Pays off with bf16/fp16 servers, where a "
        "small step leaves most values unchanged (docs/weight_sync.md).",
    )
    weight_update_delta_method: str = cfield(
        "adamw",
        "How the changed weights are found for delta transfer: 'adamw' (AReaL 2.0's name, "
        "the changes of the optimizer steps since the last sync), detected here by exact "
        "comparison of the weights cast to the servers' dtype with the committed copy, so "
        "any optimizer and any number of steps or minibatches (ppo_n_minibatches) work.",
        choices=["adamw"],
    )
    weight_update_anchor_interval: int = cfield(
        0,
        "Delta transfer: a full weight sync after this many committed deltas (an anchor "
        "that re-sends every weight); 0: no periodic anchor (only the first sync, a "
        "rolled-back delta, or servers without a delta route are sent in full); >= 0.",
    )
    workers_ready_timeout: float = cfield(
        30.0, "Seconds initialize() waits for AReaL's v2 guard processes. " + NOT_ACTED
    )

    def __post_init__(self):
        owner = type(self).__name__
        check_choice(owner, "dtype", self.dtype, _DTYPES)
        check_choice(owner, "grad_reduce_dtype", self.grad_reduce_dtype, _DTYPES)
        check_choice(
            owner, "cpu_compute_dtype", self.cpu_compute_dtype, ["float32", "bfloat16", "auto"]
        )
        if self.attn_impl not in _ATTN_IMPLS and "/" not in self.attn_impl:
            raise ValueError(
                f"{owner}.attn_impl={self.attn_impl!r} is not allowed; choose one of {_ATTN_IMPLS} "
                "or a kernels repo id 'org/repo'"
            )
        check_choice(owner, "weight_update_mode", self.weight_update_mode, ["disk", "xccl", "awex"])
        if self.weight_update_mode == "awex":
            warn_once(
                "awex",
                f"{owner}.weight_update_mode='awex' needs AReaL's AWEX transfer engine "
                "(Megatron + SGLang); running it as 'xccl' (collective broadcast)",
            )
            self.weight_update_mode = "xccl"
        check_range(owner, "logprobs_chunk_size", self.logprobs_chunk_size, gt=0)
        check_choice(owner, "optimizer_dtype", self.optimizer_dtype, ["float32", "bfloat16"])
        check_choice(
            owner, "weight_update_delta_method", self.weight_update_delta_method, ["adamw"]
        )
        check_range(
            owner, "weight_update_anchor_interval", self.weight_update_anchor_interval, ge=0
        )
        check_range(owner, "lora_rank", self.lora_rank, ge=1)
        check_range(owner, "weight_update_timeout", self.weight_update_timeout, gt=0)
        check_range(owner, "num_threads", self.num_threads, ge=1)
        check_range(owner, "temperature", self.temperature, gt=0)
        if len(self.scheduling_spec) not in (1, 2):
            raise ValueError(
                f"{owner}.scheduling_spec has {len(self.scheduling_spec)} entries; must have 1 or 2"
            )
        if self.backend:
            from areal.api.alloc_mode import ParallelStrategy

            alloc = ParallelStrategy.parse_backend(self.backend, field_name=f"{owner}.backend")
            if alloc.backend == "archon":
                if not self.backend.strip().lower().startswith("archon"):
                    self.archon.adopt_mapped_layout()
                self.archon.refuse_unsupported(owner, self.gradient_checkpointing)
