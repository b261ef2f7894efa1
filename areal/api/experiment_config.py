"""Experiment configs (``GRPOConfig``, ``PPOConfig``, ``SFTConfig``, ``RWConfig``, ``DPOConfig``), the list of fields accepted but not acted on, and the CPU fallbacks.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import MISSING as _DC_MISSING
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from areal.api.actor_config import DPOEngineConfig, PPOActorConfig, PPOCriticConfig, TeacherConfig
from areal.api.config_common import NOT_ACTED, cfield, check_range, logger, warn_once
from areal.api.dataset_config import TrainDatasetConfig, ValidDatasetConfig
from areal.api.engine_config import SchedulingSpec, TrainEngineConfig
from areal.api.health_config import RunHealthConfig
from areal.api.inference_config import GenerationHyperparameters, InferenceEngineConfig
from areal.api.server_config import SGLangConfig, vLLMConfig
from areal.api.utils_config import (
    ClusterSpecConfig,
    EvaluatorConfig,
    LauncherConfig,
    MemoryProfilerConfig,
    PerfTracerConfig,
    RecoverConfig,
    SaverConfig,
    SchedulerConfig,
    StatsLoggerConfig,
)


@dataclass
class BaseExperimentConfig:
    """Settings shared by every experiment type."""

    experiment_name: str = cfield(MISSING, "Name of the experiment (no '/'). Required.")
    trial_name: str = cfield(MISSING, "Name of the trial (no '/'). Required.")
    cluster: ClusterSpecConfig = cfield(
        help="Machines, file root and address discovery.", factory=ClusterSpecConfig
    )
    allocation_mode: str = cfield(
        "",
        "Devices per component, e.g. 'local:d1+fsdp:d2' or 'sglang:d4t2+fsdp:d8' "
        "(see areal.api.alloc_mode). Per-engine `backend` fields take precedence.",
    )
    seed: int = cfield(1, "Random seed.")
    total_train_epochs: int = cfield(1, "Epochs over the training set; >= 1.")
    total_train_steps: int | None = cfield(
        None, "Stop after this many steps; None: run all epochs."
    )
    total_train_n_seqs: int | None = cfield(
        None, "Stop after this many training samples; None: no limit."
    )
    tokenizer_path: str = cfield("", "Tokenizer directory or hub name (often ${actor.path}).")
    train_dataset: TrainDatasetConfig = cfield(help="Training data.", factory=TrainDatasetConfig)
    valid_dataset: ValidDatasetConfig | None = cfield(
        None, "Validation data; None: no evaluation set."
    )
    saver: SaverConfig = cfield(help="HuggingFace checkpoint schedule.", factory=SaverConfig)
    evaluator: EvaluatorConfig = cfield(help="Evaluation schedule.", factory=EvaluatorConfig)
    stats_logger: StatsLoggerConfig = cfield(help="Statistics logging.", factory=StatsLoggerConfig)
    recover: RecoverConfig = cfield(
        help="Recovery checkpoints and resuming.", factory=RecoverConfig
    )
    scheduler: SchedulerConfig = cfield(help="Process scheduler.", factory=SchedulerConfig)
    sglang: SGLangConfig = cfield(help="SGLang server arguments.", factory=SGLangConfig)
    vllm: vLLMConfig = cfield(help="vLLM server arguments.", factory=vLLMConfig)
    enable_offload: bool = cfield(
        False, "Offload training memory between steps (GPU). " + NOT_ACTED
    )
    perf_tracer: PerfTracerConfig | None = cfield(
        None,
        "Performance tracing: with enabled, the trainer's phases as spans in "
        "{log_dir}/perf_tracer/traces-r{rank}.jsonl (python -m areal.tools.perf_trace_converter).",
    )
    memory_profiler: MemoryProfilerConfig | None = cfield(
        None, "CUDA memory snapshots. " + NOT_ACTED
    )
    launcher: LauncherConfig = cfield(
        help="Launcher resources. " + NOT_ACTED, factory=LauncherConfig
    )
    post_exit_hook: str = cfield(
        "",
        "Shell command the launchers (areal.infra.launcher.local/ray/slurm) run once the run "
        "has ended, with LOG_DIR = the run's log directory; at most 600 s; its failure is "
        "logged and does not change the run's exit code.",
    )

    def __post_init__(self):
        owner = type(self).__name__
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            if isinstance(value, str) and "/" in value:
                raise ValueError(
                    f"{owner}.{name}={value!r} is not allowed; it must not contain '/'"
                )
        check_range(owner, "total_train_epochs", self.total_train_epochs, ge=1)
        check_range(owner, "total_train_steps", self.total_train_steps, ge=1, optional=True)
        check_range(owner, "total_train_n_seqs", self.total_train_n_seqs, ge=1, optional=True)
        if self.allocation_mode:
            from areal.api.alloc_mode import AllocationMode

            mode = AllocationMode.from_str(self.allocation_mode)
            if mode.train_backend == "archon":
                # every trained/forward-only model of this run is built by the archon engine
                for f in fields(self):
                    value = getattr(self, f.name)
                    if isinstance(value, TrainEngineConfig):
                        if "archon" not in self.allocation_mode.lower():  # mapped layout
                            value.archon.adopt_mapped_layout()
                        value.archon.refuse_unsupported(
                            f"{owner}.{f.name}", value.gradient_checkpointing
                        )


@dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning. (A YAML section `model`, this project's earlier name, is
    read as `actor` with a warning.)"""

    actor: TrainEngineConfig = cfield(help="The trained model.", factory=TrainEngineConfig)

    @property
    def model(self) -> TrainEngineConfig:
        """Read-only alias of ``actor`` (this project's earlier section name)."""
        return self.actor


@dataclass
class RWConfig(BaseExperimentConfig):
    """Reward-model training (``RWTrainer``): Bradley-Terry loss on a critic-style model with
    a scalar head (`actor.is_critic`), preference pairs (dataset type 'rw')."""

    actor: TrainEngineConfig = cfield(
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


@dataclass
class DPOConfig(BaseExperimentConfig):
    """Direct Preference Optimization (``DPOTrainer``): the trained policy ``actor`` (with
    ``beta`` / ``loss_type``) against the frozen reference ``ref`` built in the same workers;
    preference pairs (dataset type 'dpo')."""

    actor: DPOEngineConfig = cfield(help="The trained policy.", factory=DPOEngineConfig)
    ref: DPOEngineConfig = cfield(
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

    gconfig: GenerationHyperparameters = cfield(
        help="Sampling parameters of training rollouts.", factory=GenerationHyperparameters
    )
    rollout: InferenceEngineConfig = cfield(
        help="Inference servers and staleness control.", factory=InferenceEngineConfig
    )
    actor: PPOActorConfig = cfield(help="The policy and its loss.", factory=PPOActorConfig)
    ref: PPOActorConfig | None = cfield(
        None, "Frozen reference model for the KL penalty; None: no reference."
    )
    critic: PPOCriticConfig | None = cfield(None, "Value model; None: no critic (GRPO).")
    eval_gconfig: GenerationHyperparameters | None = cfield(
        None, "Sampling parameters of evaluation; None: a copy of gconfig."
    )
    async_training: bool = cfield(
        True,
        "Generate the next batches while training (bounded by rollout.max_head_offpolicyness). "
        "False: generate each batch only after the previous update.",
    )
    dynamic_bs: bool = cfield(
        False,
        "Stop collecting a batch once accepted + rejected reaches batch_size (variable batch size).",
    )
    deterministic: bool = cfield(
        False,
        "Reproducible asynchronous runs: two runs with the same seed and allocation give "
        "the same samples, rewards, losses and weights, also with max_head_offpolicyness > 0 "
        "and multi-turn workflows (batch k generated by weight version max(0, k - eta) "
        "exactly, consumed in submission order, seeds from the dataset position, built-in "
        "server requests one per forward), at a cost in throughput. Needs the built-in "
        "('local') inference server; sets rollout.deterministic.",
    )
    teacher: TeacherConfig | None = cfield(
        None,
        "On-policy distillation teacher (a frozen model scoring every trajectory; reverse-KL "
        "term weighted by teacher.rl_loss_weight / distill_loss_weight); None: no teacher.",
    )
    run_health: RunHealthConfig = cfield(
        help="Per-step alarms: entropy collapse, reward drop/saturation, length and truncation, "
        "importance-weight / KL / clip blow-ups, trainer-vs-server logprob mismatch, groups "
        "without signal, held-out divergence, reward hacking (docs/run_health.md).",
        factory=RunHealthConfig,
    )

    def __post_init__(self):
        if self.eval_gconfig is None:
            self.eval_gconfig = self.gconfig.new()
        super().__post_init__()
        if self.run_health.enabled and self.run_health.uses_rollback():
            if self.recover.mode == "disabled":
                raise ValueError(
                    f"{type(self).__name__}.run_health: action 'rollback' restores a recover "
                    "checkpoint, but recover.mode='disabled' writes none; set recover.mode to "
                    "'off', 'on' or 'auto' (and recover.freq_steps), or use 'warn'/'stop'"
                )
        owner = type(self).__name__
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"{owner}.deterministic={self.deterministic!r}; allowed: true or false"
            )
        if self.rollout.deterministic_sampling and not self.deterministic:
            # AReaL 2.0's switch maps onto this project's reproducible mode
            logger.info(
                "rollout.deterministic_sampling=true: running with deterministic=true "
                "(reproducible rollouts; docs/best_practices/reproducibility.md)"
            )
            self.deterministic = True
        if self.deterministic:
            if self.allocation_mode:
                from areal.api.alloc_mode import AllocationMode

                backend = AllocationMode.from_str(self.allocation_mode).gen_backend
                if backend not in (None, "local"):
                    raise ValueError(
                        f"{owner}.deterministic=True (set directly or by "
                        "rollout.deterministic_sampling) needs the built-in inference server "
                        f"(allocation_mode 'local:...'); got backend {backend!r} in "
                        f"allocation_mode={self.allocation_mode!r}; allowed: 'local'"
                    )
            if self.run_health.enabled and self.run_health.uses_rollback():
                raise ValueError(
                    f"{owner}.deterministic=True with a run_health 'rollback' action: a "
                    "rollback rewinds the pinned rollout schedule, which deterministic runs "
                    "cannot replay; use run_health action 'warn' or 'stop'"
                )
            self.rollout.deterministic = True


@dataclass
class GRPOConfig(PPOConfig):
    """GRPO: PPO without a critic, advantages from group-normalised rewards."""


_MEGATRON = "the Megatron-LM training backend"


_CUDA = "CUDA GPUs"


_GATEWAY = "AReaL's v2 gateway controller / inference service"


_LORA_SELECT = "per-request LoRA adapter selection (our LoRA sync names and applies the adapter)"


# The one list of fields that load (so AReaL YAMLs work unchanged) but that this project
# does not act on, as (owner class, field, what it would need). A value other than the
# default is warned about once per run (warn_not_acted_on). docs/cli_reference.md
# renders this list.
NOT_ACTED_ON: tuple[tuple[str, str, str], ...] = (
    ("TrainEngineConfig", "megatron", _MEGATRON),
    ("TrainEngineConfig", "offload", f"{_CUDA} (torch_memory_saver)"),
    ("TrainEngineConfig", "use_kernels", f"{_CUDA} (HuggingFace kernels)"),
    ("TrainEngineConfig", "peft_type", "peft adapter types other than LoRA"),
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
    ("GenerationHyperparameters", "lora_name", _LORA_SELECT),
    ("GenerationHyperparameters", "use_beam_search", "vLLM beam search"),
    ("InferenceEngineConfig", "use_lora", _LORA_SELECT),
    ("InferenceEngineConfig", "model", _GATEWAY),
    ("InferenceEngineConfig", "routing_strategy", _GATEWAY),
    ("InferenceEngineConfig", "poll_interval", _GATEWAY),
    ("InferenceEngineConfig", "api_url", _GATEWAY),
    ("InferenceEngineConfig", "provider_api_key", _GATEWAY),
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
    ("BaseExperimentConfig", "memory_profiler", f"{_CUDA} (memory snapshots)"),
    ("BaseExperimentConfig", "launcher", "AReaL's SPMD launchers"),
    ("AgentConfig", "message_preprocessors", "AReaL 2.0's agent service"),
    ("AgentConfig", "prefix_matcher", "AReaL 2.0's agent service"),
    ("AgentConfig", "drop_retry_orphans", "AReaL 2.0's agent service"),
    ("InferenceEngineConfig", "workers_ready_timeout", _GATEWAY),
    ("InferenceEngineConfig", "lora_name", _LORA_SELECT),
    ("TrainEngineConfig", "workers_ready_timeout", _GATEWAY),
    ("TrainEngineConfig", "logprobs_chunk_size", "a chunked log-probability head"),
    ("TrainEngineConfig", "optimizer_dtype", "bf16 master weights (fp32 is kept here)"),
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


def field_default(f: Any) -> Any:
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
            default = field_default(f)
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
        warn_once(
            "not-acted:" + ",".join(p for p, _ in found),
            f"These settings are accepted but not acted on here: {listing}. See "
            "docs/cli_reference.md, 'Accepted but not acted on'.",
        )
    return [p for p, _ in found]


# Train-engine dtypes the CPU path maps to float32 (see docs/cli_reference.md, "Running
# a GPU config on CPU"): torch runs bfloat16 on CPU, but measured on this project's
# 2-core CPU (no AVX512-BF16/AMX) a tiny-model train step took 10.1 s in bfloat16 vs
# 1.6 s in float32, and float16 matmuls on CPU are slower still or unsupported.
_CPU_DTYPE_FIELDS = ("dtype", "grad_reduce_dtype")


def walk_dataclasses(obj: Any, prefix: str = ""):
    """(dotted path, instance) of ``obj`` and every dataclass nested in it (lists too)."""
    if not is_dataclass(obj) or isinstance(obj, type):
        return
    yield prefix.rstrip("."), obj
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from walk_dataclasses(value, f"{prefix}{f.name}.")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from walk_dataclasses(item, f"{prefix}{f.name}.{i}.")


def apply_cpu_fallbacks(config: Any) -> list[str]:
    """With ``cluster.n_gpus_per_node == 0``, make a GPU config runnable on CPU.

    Every ``SchedulingSpec.gpu`` > 0 becomes 0, and every train-engine ``dtype`` /
    ``grad_reduce_dtype`` other than float32 becomes float32; each kind is logged once,
    naming the changed keys. Returns the changed dotted keys. No-op for configs that are
    no ``BaseExperimentConfig`` (no ``cluster`` section) or that have GPUs.
    """
    if not isinstance(config, BaseExperimentConfig) or config.cluster.n_gpus_per_node != 0:
        return []
    gpu_keys: list[str] = []
    dtype_keys: list[str] = []
    for path, obj in walk_dataclasses(config):
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
        warn_once(
            "cpu-gpu:" + ",".join(gpu_keys),
            "cluster.n_gpus_per_node=0: GPU requests dropped (set to 0): " + ", ".join(gpu_keys),
        )
    if dtype_keys:
        warn_once(
            "cpu-dtype:" + ",".join(dtype_keys),
            "cluster.n_gpus_per_node=0: training dtypes mapped to float32 on CPU: "
            + ", ".join(dtype_keys),
        )
    return gpu_keys + dtype_keys
