"""Configuration dataclasses and the YAML/command-line loader: the one import path.

Every configurable part of the system is a dataclass. Section and field names, nesting,
types and defaults follow AReaL's configuration reference, so that a YAML written for
AReaL loads unchanged; fields this project does not act on are listed in
``NOT_ACTED_ON``. The classes live in modules by family, all re-exported here, so
``from areal.api.cli_args import X`` works for every public name:

- ``config_common``: field helpers, validation messages, once-per-run warnings;
- ``engine_config``: ``TrainEngineConfig``, ``OptimizerConfig``, ``MicroBatchSpec``,
  ``NormConfig``, FSDP / Megatron / Archon / FP8 sections, ``SchedulingSpec``;
- ``actor_config``: ``PPOActorConfig``, ``RejectionSamplingConfig``, ``PPOCriticConfig``,
  ``TeacherConfig``, ``DPOEngineConfig``;
- ``inference_config``: ``GenerationHyperparameters``, ``AgentConfig``,
  ``InferenceEngineConfig``; ``server_config``: ``vLLMConfig``, ``SGLangConfig``;
- ``dataset_config``: ``TrainDatasetConfig``, ``ValidDatasetConfig``;
- ``utils_config``: saver, evaluator, recover, stats loggers, tracers, cluster, scheduler,
  launcher;
- ``experiment_config``: ``GRPOConfig``, ``PPOConfig``, ``SFTConfig``, ``RWConfig``,
  ``DPOConfig``, ``NOT_ACTED_ON``, ``apply_cpu_fallbacks``;
- ``config_loader``: ``load_expr_config``, ``build_config``, ``save_config``,
  ``compose_yaml`` (a YAML with its Hydra ``defaults:`` list composed).

Field order inside a class is required -> common -> rare. ``docs/cli_reference.md`` is
generated from these classes (``python docs/generate_cli_docs.py``).

Loading::

    config, config_file = load_expr_config(sys.argv[1:], GRPOConfig)

reads ``--config file.yaml``, applies overrides (``a.b=value``, ``+a.b=value``,
``a.0.b=value``, ``~a.b``), resolves ``${...}`` interpolations, validates (unknown keys,
types, ``__post_init__`` checks) and writes the resolved configuration to
``get_log_path(config)/config.yaml``.
"""

from __future__ import annotations

# AReaL's cli_args exposes these (some of its examples import them from here).
from dataclasses import asdict, dataclass, field  # noqa: F401

from areal.api import config_common as _config_common
from areal.api import dataset_config as _dataset_config
from areal.api import experiment_config as _experiment_config
from areal.api.actor_config import (
    DPOEngineConfig,
    PPOActorConfig,
    PPOCriticConfig,
    RejectionSamplingConfig,
    TeacherConfig,
    legacy_rejection_sampling,
)
from areal.api.config_common import (
    NOT_ACTED,
    WARNED,
    cfield,
    check_choice,
    check_range,
    conf_as_dict,
    warn_once,
)
from areal.api.config_loader import (
    build_config,
    compose_yaml,
    describe_type,
    get_log_path,
    load_expr_config,
    save_config,
    to_structured_cfg,
)
from areal.api.dataset_config import (
    DatasetConfig,
    TrainDatasetConfig,
    ValidDatasetConfig,
)
from areal.api.engine_config import (
    PACKING_ALGORITHMS,
    ArchonEngineConfig,
    ArchonFP8Config,
    FSDPEngineConfig,
    FSDPWrapPolicy,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    SchedulingSpec,
    SchedulingStrategy,
    SchedulingStrategyType,
    TrainEngineConfig,
    default_scheduling_spec,
)
from areal.api.experiment_config import (
    NOT_ACTED_ON,
    BaseExperimentConfig,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    RWConfig,
    SFTConfig,
    apply_cpu_fallbacks,
    field_default,
    not_acted_on_settings,
    walk_dataclasses,
    warn_not_acted_on,
)
from areal.api.health_config import (
    ACTIONABLE_ALARMS,
    ALARMS,
    HEALTH_ACTIONS,
    INFORMATIONAL_ALARMS,
    WARNING_ALARMS,
    RunHealthConfig,
)
from areal.api.inference_config import (
    OPENAI_UNSUPPORTED_GCONFIG_ARGS,
    AgentConfig,
    GenerationHyperparameters,
    InferenceEngineConfig,
    OpenAIProxyConfig,
)
from areal.api.megatron_config import (
    DistributedDataParallelConfig,
    FP8EngineConfig,
    MegatronEngineConfig,
)
from areal.api.server_config import (
    SGLANG_SERVER_MODULE,
    VLLM_SERVER_MODULE,
    SGLangConfig,
    get_py_cmd,
    split_host_port,
    vLLMConfig,
    with_endpoint,
)
from areal.api.utils_config import (
    ClusterSpecConfig,
    EvaluatorConfig,
    LauncherConfig,
    MemoryProfilerConfig,
    NameResolveConfig,
    PerfTracerConfig,
    RecoverConfig,
    SaverConfig,
    SchedulerConfig,
    SessionTracerConfig,
    SlurmLauncherConfig,
    StatsLoggerConfig,
    SwanlabConfig,
    TensorBoardConfig,
    TrackioConfig,
    WandBConfig,
)

# Helpers other modules and tests reach through cli_args (under their old private names).
_WARNED = _config_common.WARNED
_DatasetConfig = _dataset_config.DatasetConfig  # AReaL's name of the dataset base
_warn_once = _config_common.warn_once
_field = _config_common.cfield
_check_choice = _config_common.check_choice
_check_range = _config_common.check_range
_NOT_ACTED = _config_common.NOT_ACTED
_walk_dataclasses = _experiment_config.walk_dataclasses
_field_default = _experiment_config.field_default

__all__ = [
    "ACTIONABLE_ALARMS",
    "ALARMS",
    "HEALTH_ACTIONS",
    "INFORMATIONAL_ALARMS",
    "WARNING_ALARMS",
    "AgentConfig",
    "ArchonEngineConfig",
    "ArchonFP8Config",
    "BaseExperimentConfig",
    "ClusterSpecConfig",
    "DPOConfig",
    "DPOEngineConfig",
    "DatasetConfig",
    "DistributedDataParallelConfig",
    "EvaluatorConfig",
    "FP8EngineConfig",
    "FSDPEngineConfig",
    "FSDPWrapPolicy",
    "GRPOConfig",
    "GenerationHyperparameters",
    "InferenceEngineConfig",
    "LauncherConfig",
    "MegatronEngineConfig",
    "MemoryProfilerConfig",
    "MicroBatchSpec",
    "NOT_ACTED_ON",
    "NameResolveConfig",
    "NormConfig",
    "OPENAI_UNSUPPORTED_GCONFIG_ARGS",
    "OpenAIProxyConfig",
    "OptimizerConfig",
    "PACKING_ALGORITHMS",
    "PPOActorConfig",
    "PPOConfig",
    "PPOCriticConfig",
    "PerfTracerConfig",
    "RWConfig",
    "RecoverConfig",
    "RunHealthConfig",
    "RejectionSamplingConfig",
    "SFTConfig",
    "SGLANG_SERVER_MODULE",
    "SGLangConfig",
    "SaverConfig",
    "SchedulerConfig",
    "SchedulingSpec",
    "SchedulingStrategy",
    "SchedulingStrategyType",
    "SessionTracerConfig",
    "SlurmLauncherConfig",
    "StatsLoggerConfig",
    "SwanlabConfig",
    "TeacherConfig",
    "TensorBoardConfig",
    "TrackioConfig",
    "TrainDatasetConfig",
    "TrainEngineConfig",
    "VLLM_SERVER_MODULE",
    "ValidDatasetConfig",
    "WandBConfig",
    "apply_cpu_fallbacks",
    "build_config",
    "compose_yaml",
    "conf_as_dict",
    "describe_type",
    "get_log_path",
    "get_py_cmd",
    "legacy_rejection_sampling",
    "load_expr_config",
    "not_acted_on_settings",
    "save_config",
    "split_host_port",
    "to_structured_cfg",
    "vLLMConfig",
    "warn_not_acted_on",
    "NOT_ACTED",
    "WARNED",
    "cfield",
    "check_choice",
    "check_range",
    "warn_once",
    "default_scheduling_spec",
    "field_default",
    "walk_dataclasses",
    "with_endpoint",
]
