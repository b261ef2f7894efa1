"""Utility configs: saving, evaluation, recovery, statistics loggers, tracers, cluster, scheduler, launcher.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from areal.api.config_common import NOT_ACTED, cfield, check_choice, check_range


@dataclass
class _Timer:
    experiment_name: str = cfield(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = cfield(MISSING, "Trial name; defaults to the top-level trial_name.")
    fileroot: str = cfield(MISSING, "Root directory of outputs; defaults to cluster.fileroot.")
    freq_epochs: int | None = cfield(
        None, "Trigger every this many epochs; None: never by epochs; >= 1."
    )
    freq_steps: int | None = cfield(
        None, "Trigger every this many steps; None: never by steps; >= 1."
    )
    freq_secs: int | None = cfield(
        None, "Trigger every this many seconds; None: never by time; >= 1."
    )

    def __post_init__(self):
        owner = type(self).__name__
        for name in ("freq_epochs", "freq_steps", "freq_secs"):
            check_range(owner, name, getattr(self, name), ge=1, optional=True)


@dataclass
class SaverConfig(_Timer):
    """When HuggingFace-format checkpoints are saved."""

    mode: str = cfield(
        "auto",
        "'auto', 'sync' or 'async'. Hugging Face exports are written synchronously in "
        "every mode (rank 0 writes each shard on a thread while the next is gathered); "
        "the asynchronous write is that of recover checkpoints (recover.save_mode).",
        choices=["auto", "sync", "async"],
    )

    def __post_init__(self):
        super().__post_init__()
        check_choice("SaverConfig", "mode", self.mode, ["auto", "sync", "async"])


@dataclass
class EvaluatorConfig(_Timer):
    """When the model is evaluated on the validation set."""

    eval_before_train: bool = cfield(
        False, "Evaluate once before the first training step, then on the usual schedule."
    )


_RECOVER_MODES = ["on", "off", "auto", "disabled"]
_SAVE_MODES = ["auto", "sync", "async"]


@dataclass
class RecoverConfig(_Timer):
    """Recovery checkpoints (model, optimizer, dataloader, counters) and resuming from them."""

    mode: str = cfield(
        "disabled",
        "'on'/'auto': resume from the last recovery checkpoint when one exists; "
        "'off'/'disabled': always start fresh.",
        choices=_RECOVER_MODES,
    )
    retries: int = cfield(3, "How many times a failed run is restarted when recovery is on; >= 0.")
    no_save_optim: bool = cfield(False, "Leave optimizer states out of recovery checkpoints.")
    no_load_optim: bool = cfield(False, "Do not restore optimizer states when resuming.")
    save_mode: str = cfield(
        "auto",
        "'sync': a recover checkpoint is on disk before training continues; 'async': the "
        "state is copied to CPU memory and written in the background while training goes "
        "on (valid once the write has finished; the next checkpoint and shutdown wait for "
        "it); 'auto': async from 64 MiB of model + optimizer state per rank, else sync.",
        choices=_SAVE_MODES,
    )

    def __post_init__(self):
        super().__post_init__()
        check_choice("RecoverConfig", "mode", self.mode, _RECOVER_MODES)
        check_choice("RecoverConfig", "save_mode", self.save_mode, _SAVE_MODES)
        check_range("RecoverConfig", "retries", self.retries, ge=0)


_WANDB_MODES = ["online", "offline", "disabled"]


@dataclass
class WandBConfig:
    """Weights & Biases logging (needs the optional `wandb` package unless disabled)."""

    mode: str = cfield("disabled", "'online', 'offline' or 'disabled'.", choices=_WANDB_MODES)
    wandb_base_url: str = cfield("", "W&B server URL; empty for the default.")
    wandb_api_key: str = cfield("", "W&B API key; empty: taken from the environment.")
    entity: str | None = cfield(None, "W&B entity (team or user).")
    project: str | None = cfield(None, "W&B project; None: experiment_name.")
    name: str | None = cfield(None, "Run name; None: trial_name.")
    job_type: str | None = cfield(None, "W&B job type.")
    group: str | None = cfield(None, "W&B run group.")
    notes: str | None = cfield(None, "Run notes.")
    tags: list[str] | None = cfield(None, "Run tags.")
    config: dict | None = cfield(None, "Extra run config.")
    id_suffix: str | None = cfield("train", "Suffix of the run id.")

    def __post_init__(self):
        check_choice("WandBConfig", "mode", self.mode, _WANDB_MODES)


@dataclass
class SwanlabConfig:
    """SwanLab logging through the `swanlab` package ('offline'/'local': a run file under `logdir`)."""

    project: str | None = cfield(None, "SwanLab project.")
    name: str | None = cfield(None, "Run name.")
    config: dict | None = cfield(None, "Extra run config.")
    logdir: str | None = cfield(None, "Local log directory; None: {log_path}/swanlab.")
    mode: str | None = cfield(
        "disabled",
        "'cloud'/'online', 'local', 'offline' (run file under logdir, no network) or 'disabled'.",
    )
    api_key: str | None = cfield(None, "API key; None: taken from SWANLAB_API_KEY at run time.")

    def __post_init__(self):
        check_choice(
            "SwanlabConfig",
            "mode",
            self.mode or "disabled",
            ["cloud", "online", "local", "offline", "disabled"],
        )


@dataclass
class TensorBoardConfig:
    """TensorBoard logging."""

    path: str | None = cfield(None, "Directory of TensorBoard event files; None: no TensorBoard.")


@dataclass
class TrackioConfig:
    """Trackio logging through the `trackio` package ('local': SQLite under TRACKIO_DIR)."""

    mode: str = cfield(
        "disabled", "'disabled', 'online' or 'local'.", choices=["disabled", "online", "local"]
    )
    project: str | None = cfield(None, "Project; None: experiment_name.")
    name: str | None = cfield(None, "Run name; None: trial_name.")
    space_id: str | None = cfield(None, "HuggingFace Space for a remote dashboard.")

    def __post_init__(self):
        check_choice("TrackioConfig", "mode", self.mode, ["disabled", "online", "local"])


@dataclass
class StatsLoggerConfig:
    """Where training statistics go (log file always; W&B / TensorBoard optionally)."""

    experiment_name: str = cfield(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = cfield(MISSING, "Trial name; defaults to the top-level trial_name.")
    fileroot: str = cfield(MISSING, "Root directory of logs; defaults to cluster.fileroot.")
    wandb: WandBConfig = cfield(help="Weights & Biases.", factory=WandBConfig)
    tensorboard: TensorBoardConfig = cfield(help="TensorBoard.", factory=TensorBoardConfig)
    swanlab: SwanlabConfig = cfield(help="SwanLab.", factory=SwanlabConfig)
    trackio: TrackioConfig = cfield(help="Trackio.", factory=TrackioConfig)


@dataclass
class SessionTracerConfig:
    """Per-session lifecycle tracing. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    enabled: bool = cfield(False, "Record session lifecycles.")
    flush_threshold: int = cfield(256, "Records buffered before a flush.")


@dataclass
class MemoryProfilerConfig:
    """CUDA memory snapshots. This project accepts it so AReaL YAMLs load, but does not act on it (needs CUDA)."""

    profile_steps: list[int] = cfield(
        help="Steps at which a memory snapshot is taken.", factory=lambda: [0, 1]
    )
    max_entries: int = cfield(100000, "Entries of the memory-history ring buffer.")


@dataclass
class PerfTracerConfig:
    """Performance tracing: spans of the trainer's phases, one JSONL file per rank."""

    experiment_name: str = cfield(
        MISSING, "Experiment name; defaults to the top-level experiment_name."
    )
    trial_name: str = cfield(MISSING, "Trial name; defaults to the top-level trial_name.")
    fileroot: str = cfield(MISSING, "Root directory; defaults to cluster.fileroot.")
    enabled: bool = cfield(False, "Capture performance traces.")
    save_interval: int = cfield(1, "Flush traces every this many steps; >= 1.")
    profile_steps: list[int] | None = cfield(None, "Steps with detailed profiles. " + NOT_ACTED)
    session_tracer: SessionTracerConfig | None = cfield(
        None, "Session tracing (session phases are recorded as plain spans)."
    )

    def __post_init__(self):
        check_range("PerfTracerConfig", "save_interval", self.save_interval, ge=1)


@dataclass
class NameResolveConfig:
    """Key-value store through which processes find each other's addresses."""

    type: str = cfield(
        "nfs",
        "'nfs' (files under nfs_record_root; also works on one machine), 'etcd3' or 'ray'.",
        choices=["nfs", "etcd3", "ray"],
    )
    nfs_record_root: str = cfield(
        "/tmp/areal/name_resolve", "Directory of the records; must be shared by all nodes."
    )
    etcd3_addr: str = cfield("localhost:2379", "host:port of the etcd3 server.")
    ray_actor_name: str = cfield("ray_kv_store", "Name of the Ray actor holding the store.")

    def __post_init__(self):
        check_choice("NameResolveConfig", "type", self.type, ["nfs", "etcd3", "ray"])


@dataclass
class ClusterSpecConfig:
    """The machines the experiment runs on."""

    fileroot: str = cfield(
        "/tmp/areal/", "Root of logs and checkpoints; must be visible from every node."
    )
    n_nodes: int = cfield(32, "Number of nodes available; >= 1.")
    n_gpus_per_node: int = cfield(8, "GPUs per node; 0 on CPU-only machines; >= 0.")
    cluster_name: str = cfield("local", "Cluster name (selects cluster-specific settings).")
    name_resolve: NameResolveConfig = cfield(help="Address discovery.", factory=NameResolveConfig)

    def __post_init__(self):
        check_range("ClusterSpecConfig", "n_nodes", self.n_nodes, ge=1)
        check_range("ClusterSpecConfig", "n_gpus_per_node", self.n_gpus_per_node, ge=0)


_SCHEDULER_TYPES = ["local", "ray", "slurm", None]


@dataclass
class SchedulerConfig:
    """Which scheduler creates the worker processes."""

    type: str | None = cfield(
        None,
        "'local' (subprocesses on this machine), 'ray' (Ray actors on a Ray cluster), "
        "'slurm' (Slurm jobs); None behaves as 'local'.",
        choices=_SCHEDULER_TYPES,
    )
    endpoint: str = cfield("http://localhost:8081", "Scheduler service endpoint. " + NOT_ACTED)
    deploy_mode: str = cfield("separation", "Deployment mode. " + NOT_ACTED)
    functioncall_service_domain: str = cfield(
        "http://localhost:8080", "Function-call service. " + NOT_ACTED
    )
    reward_functioncall_config: dict = cfield(
        help="Reward function-call config. " + NOT_ACTED, factory=dict
    )
    reward_model_path: str = cfield("", "Reward model path. " + NOT_ACTED)
    reward_model_service_url: str = cfield(
        "http://localhost:30000/classify", "Reward model service. " + NOT_ACTED
    )

    def __post_init__(self):
        check_choice("SchedulerConfig", "type", self.type, _SCHEDULER_TYPES)


@dataclass
class SlurmLauncherConfig:
    """Slurm options of the launcher. This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    srun_additional_args: str = cfield("--mpi=pmi2 -K --chdir $PWD", "Extra srun arguments.")
    additional_bash_cmds: list[str] | None = cfield(None, "Shell commands run before each task.")
    container_type: str = cfield(
        "apptainer", "'apptainer' or 'none'.", choices=["apptainer", "none"]
    )
    mount: str = cfield("/storage:/storage", "Container bind mount.")
    trainer_image: str | None = cfield(None, "Container image of trainers.")
    inference_server_image: str | None = cfield(None, "Container image of inference servers.")


@dataclass
class LauncherConfig:
    """Resources of launched processes (AReaL's SPMD launchers). This project accepts it so AReaL YAMLs load, but does not act on it yet."""

    inference_server_cpus_per_gpu: int = cfield(4, "CPUs per GPU of inference servers.")
    inference_server_mem_per_gpu: int = cfield(
        32 * 1024, "Memory (MB) per GPU of inference servers."
    )
    trainer_cpus_per_gpu: int = cfield(4, "CPUs per GPU of trainers.")
    trainer_mem_per_gpu: int = cfield(32 * 1024, "Memory (MB) per GPU of trainers.")
    inference_server_env_vars: str = cfield("", "Environment of inference servers, 'A=1,B=2'.")
    trainer_env_vars: str = cfield("", "Environment of trainers, 'A=1,B=2'.")
    slurm: SlurmLauncherConfig = cfield(help="Slurm options.", factory=SlurmLauncherConfig)
    offload: bool = cfield(False, "Offload training memory between steps.")
