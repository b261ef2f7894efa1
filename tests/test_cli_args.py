"""Tests of the config dataclasses and load_expr_config."""

from __future__ import annotations

import os
import textwrap

import pytest
import yaml

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    DatasetConfig,
    GenerationHyperparameters,
    GRPOConfig,
    InferenceEngineConfig,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
    PPOConfig,
    PPOCriticConfig,
    RecoverConfig,
    SchedulerConfig,
    SchedulingStrategy,
    SFTConfig,
    TrainEngineConfig,
    WandBConfig,
    build_config,
    get_log_path,
    load_expr_config,
)

# An AReaL-style GRPO experiment (layout of AReaL's examples/math/*_grpo.yaml), written
# for these tests: interpolations, per-section experiment names, a scheduling_spec list
# shared by interpolation, sections this project does not act on (sglang, perf_tracer).
AREAL_STYLE_GRPO_YAML = """\
experiment_name: math-grpo
trial_name: run1
seed: 7
enable_offload: false
total_train_epochs: 3
tokenizer_path: ${actor.path}

cluster:
  n_nodes: 1
  n_gpus_per_node: 2
  fileroot: FILEROOT
  name_resolve:
    type: nfs
    nfs_record_root: FILEROOT/name_resolve

allocation_mode: vllm:d1p1t1+d1p1t1

scheduler:
  type: null

rollout:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  max_concurrent_rollouts: 64
  queue_size: null
  consumer_batch_size: ${train_dataset.batch_size}
  max_head_offpolicyness: 1
  enable_rollout_tracing: false
  scheduling_spec: ${actor.scheduling_spec}
  fileroot: ${cluster.fileroot}
  tokenizer_path: ${tokenizer_path}
  dump_to_file: false

gconfig:
  n_samples: 8
  min_new_tokens: 0
  max_new_tokens: 512
  greedy: false
  temperature: 0.9

actor:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  path: /models/tiny-qwen
  init_from_scratch: false
  disable_dropout: true
  gradient_checkpointing: false
  dtype: float32
  mb_spec:
    max_tokens_per_mb: 4096
  optimizer:
    type: adam
    lr: 2.5e-6
    weight_decay: 0.0
    beta1: 0.9
    beta2: 0.99
    eps: 1e-8
    lr_scheduler_type: cosine
    gradient_clipping: 0.5
    warmup_steps_proportion: 0.01
  eps_clip: 0.2
  reward_scaling: 5.0
  reward_bias: 0.0
  kl_ctl: 0.0
  ppo_n_minibatches: 2
  recompute_logprob: true
  use_decoupled_loss: true
  behav_imp_weight_cap: 4.0
  reward_norm:
    mean_level: group
    std_level: group
    group_size: ${gconfig.n_samples}
  adv_norm:
    mean_level: batch
    std_level: batch
  weight_update_mode: xccl
  max_new_tokens: ${gconfig.max_new_tokens}
  scheduling_spec:
    - task_type: worker
      port_count: 2
      gpu: 0
      cpu: 1
      mem: 8
      cmd: python3 -m some.worker
      env_vars: {}

ref:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  path: ${actor.path}
  init_from_scratch: false
  disable_dropout: true
  dtype: ${actor.dtype}
  mb_spec:
    max_tokens_per_mb: 4096
  optimizer: null
  scheduling_strategy:
    type: colocation
    target: actor
  scheduling_spec: ${actor.scheduling_spec}

sglang:
  model_path: ${actor.path}
  random_seed: ${seed}
  skip_tokenizer_init: true
  dtype: ${actor.dtype}
  max_running_requests: null
  context_length: 4096
  mem_fraction_static: 0.7

vllm:
  model: ${actor.path}
  seed: ${seed}
  skip_tokenizer_init: false
  dtype: ${actor.dtype}
  max_model_len: 4096
  gpu_memory_utilization: 0.7

train_dataset:
  batch_size: 16
  shuffle: true
  pin_memory: false
  num_workers: 0
  path: /data/math/train.jsonl
  type: rl
  max_length: 256

valid_dataset:
  batch_size: 32
  pin_memory: false
  num_workers: 0
  path: /data/math/test.jsonl
  type: rl

saver:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  fileroot: ${cluster.fileroot}
  freq_epochs: 1
  freq_steps: null
  freq_secs: null

recover:
  mode: disabled
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  fileroot: ${cluster.fileroot}
  freq_epochs: 1
  freq_steps: null
  freq_secs: 1800

evaluator:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  fileroot: ${cluster.fileroot}
  freq_epochs: 1
  freq_steps: null
  freq_secs: null

stats_logger:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  fileroot: ${cluster.fileroot}
  wandb:
    mode: disabled

perf_tracer:
  experiment_name: ${experiment_name}
  trial_name: ${trial_name}
  fileroot: ${cluster.fileroot}
  enabled: false
  session_tracer:
    enabled: false
"""

MINIMAL_GRPO_YAML = """\
experiment_name: exp
trial_name: t0
cluster:
  fileroot: FILEROOT
train_dataset:
  path: /data/train.jsonl
  type: rl
  batch_size: 4
actor:
  path: /models/tiny
  optimizer:
    lr: 1.0e-4
"""


def _write(tmp_path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text.replace("FILEROOT", str(tmp_path / "root")))
    return str(path)


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("factory", "field_name"),
    [
        (lambda: OptimizerConfig(lr_scheduler_type="step"), "lr_scheduler_type"),
        (lambda: OptimizerConfig(type="adagrad"), "type"),
        (lambda: OptimizerConfig(beta2=1.0), "beta2"),
        (lambda: OptimizerConfig(warmup_steps_proportion=1.5), "warmup_steps_proportion"),
        (lambda: TrainEngineConfig(dtype="float8"), "dtype"),
        (lambda: TrainEngineConfig(num_threads=0), "num_threads"),
        (lambda: TrainEngineConfig(attn_impl="magic"), "attn_impl"),
        (lambda: TrainEngineConfig(backend="fsdp:d0"), "backend"),
        (lambda: PPOActorConfig(eps_clip=-0.1), "eps_clip"),
        (lambda: PPOActorConfig(c_clip=0.5), "c_clip"),
        (lambda: PPOActorConfig(kl_estimator="k4"), "kl_estimator"),
        (lambda: PPOActorConfig(importance_sampling_level="batch"), "importance_sampling_level"),
        (lambda: PPOActorConfig(behav_imp_weight_cap=1.0), "behav_imp_weight_cap"),
        (lambda: PPOActorConfig(discount=1.5), "discount"),
        (lambda: PPOActorConfig(m2_threshold=-0.1), "m2_threshold"),
        (lambda: PPOCriticConfig(eps_clip=-1.0), "eps_clip"),
        (lambda: NormConfig(mean_level="token"), "mean_level"),
        (lambda: NormConfig(std_level="global"), "std_level"),
        (lambda: MicroBatchSpec(max_tokens_per_mb=0), "max_tokens_per_mb"),
        (lambda: InferenceEngineConfig(max_head_offpolicyness=-1), "max_head_offpolicyness"),
        (lambda: InferenceEngineConfig(consumer_batch_size=0), "consumer_batch_size"),
        (lambda: InferenceEngineConfig(schedule_policy="random"), "schedule_policy"),
        (lambda: DatasetConfig(path="x", type="rl", batch_size=0), "batch_size"),
        (lambda: RecoverConfig(mode="sometimes"), "mode"),
        (lambda: WandBConfig(mode="cloud"), "mode"),
        (lambda: SchedulerConfig(type="kubernetes"), "type"),
        (lambda: SchedulingStrategy(type="colocation"), "target"),
        (lambda: ClusterSpecConfig(n_nodes=0), "n_nodes"),
        (lambda: BaseExperimentConfig(total_train_epochs=0), "total_train_epochs"),
        (lambda: BaseExperimentConfig(allocation_mode="tpu:d2"), "allocation_mode"),
    ],
)
def test_config_bad_value_raises_valueerror_naming_field(factory, field_name):
    with pytest.raises(ValueError, match=field_name):
        factory()


def test_choice_error_lists_allowed_values():
    with pytest.raises(ValueError) as info:
        OptimizerConfig(lr_scheduler_type="step")
    msg = str(info.value)
    assert "'step'" in msg and "constant" in msg and "linear" in msg and "cosine" in msg


def test_decoupled_loss_without_recompute_implies_recompute():
    # As AReaL: use_decoupled_loss implicitly enables recompute_logprob.
    cfg = PPOActorConfig(use_decoupled_loss=True, recompute_logprob=False)
    assert cfg.recompute_logprob is True


def test_sapo_with_decoupled_loss_raises():
    with pytest.raises(ValueError, match="use_sapo_loss.*use_decoupled_loss"):
        PPOActorConfig(use_sapo_loss=True, use_decoupled_loss=True, recompute_logprob=True)
    # each alone is fine
    assert PPOActorConfig(use_sapo_loss=True).use_sapo_loss
    assert PPOActorConfig(use_decoupled_loss=True, recompute_logprob=True).use_decoupled_loss


def test_overlong_penalty_without_tokens_raises():
    with pytest.raises(ValueError, match="overlong_tokens"):
        PPOActorConfig(overlong_reward_penalty=True)


def test_norm_level_none_string_becomes_none():
    norm = NormConfig(mean_level="none", std_level="None")
    assert norm.mean_level is None and norm.std_level is None


def test_newer_behave_cap_spelling_overrides_cap():
    assert PPOActorConfig(behave_imp_weight_cap=3.0).behav_imp_weight_cap == 3.0


def test_microbatch_new_unknown_field_raises():
    spec = MicroBatchSpec(n_mbs=2)
    assert MicroBatchSpec.new(spec, max_tokens_per_mb=128).n_mbs == 2
    with pytest.raises(ValueError, match="max_tokens"):
        MicroBatchSpec.new(spec, max_tokens=128)


def test_every_field_has_help_text():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "generate_cli_docs.py"
    spec = importlib.util.spec_from_file_location("generate_cli_docs", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    collect_classes = gen.collect_classes

    missing = []
    for cls in collect_classes():
        for f in cls.__dataclass_fields__.values():
            if not f.metadata.get("help"):
                missing.append(f"{cls.__name__}.{f.name}")
    assert missing == []


# ------------------------------------------------------------------ loading


def test_load_minimal_yaml_with_overrides_applies_values(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    cfg, config_file = load_expr_config(
        ["--config", path, "actor.optimizer.lr=3e-5", "gconfig.n_samples=4", "seed=11"], GRPOConfig
    )
    assert isinstance(cfg, GRPOConfig)
    assert config_file == os.path.abspath(path)
    assert cfg.actor.optimizer.lr == pytest.approx(3e-5)
    assert cfg.gconfig.n_samples == 4
    assert cfg.seed == 11
    assert isinstance(cfg.actor.mb_spec, MicroBatchSpec)
    assert cfg.train_dataset.batch_size == 4
    # defaults follow AReaL's
    assert cfg.rollout.max_head_offpolicyness == 0
    assert cfg.actor.eps_clip == 0.2 and cfg.actor.kl_ctl == 0.1
    assert cfg.ref is None and cfg.critic is None


def test_load_plus_key_override_sets_key_absent_from_yaml(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    cfg, _ = load_expr_config(
        ["--config", path, "+scheduler.type=local", "+actor.adv_norm.mean_level=group", "++seed=5"],
        GRPOConfig,
    )
    assert cfg.scheduler.type == "local"
    assert isinstance(cfg.actor.adv_norm, NormConfig) and cfg.actor.adv_norm.mean_level == "group"
    assert cfg.seed == 5


def test_load_interpolation_resolves_other_keys(tmp_path):
    text = (
        MINIMAL_GRPO_YAML
        + "tokenizer_path: ${actor.path}\nrollout:\n  consumer_batch_size: ${train_dataset.batch_size}\n"
    )
    path = _write(tmp_path, text)
    cfg, _ = load_expr_config(["--config", path, "train_dataset.batch_size=12"], GRPOConfig)
    assert cfg.tokenizer_path == "/models/tiny"
    assert cfg.rollout.consumer_batch_size == 12


def test_load_subsections_inherit_names_and_fileroot(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    cfg, _ = load_expr_config(["--config", path], GRPOConfig)
    root = str(tmp_path / "root")
    assert (cfg.actor.experiment_name, cfg.actor.trial_name) == ("exp", "t0")
    assert (cfg.rollout.experiment_name, cfg.rollout.fileroot) == ("exp", root)
    assert (cfg.saver.fileroot, cfg.stats_logger.fileroot, cfg.recover.fileroot) == (
        root,
        root,
        root,
    )
    assert cfg.eval_gconfig == cfg.gconfig and cfg.eval_gconfig is not cfg.gconfig


def test_load_unknown_key_suggests_closest(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    with pytest.raises(ValueError) as info:
        load_expr_config(["--config", path, "actor.optimizer.learning_rat=1"], GRPOConfig)
    assert "actor.optimizer.learning_rat" in str(info.value)
    with pytest.raises(ValueError) as info:
        load_expr_config(["--config", path, "actor.eps_clipp=0.3"], GRPOConfig)
    msg = str(info.value)
    assert "actor.eps_clipp" in msg and "did you mean" in msg and "actor.eps_clip" in msg


def test_load_unknown_key_in_yaml_is_error(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML + "rollout:\n  max_head_offpolicynes: 2\n")
    with pytest.raises(
        ValueError, match=r"rollout\.max_head_offpolicynes.*rollout\.max_head_offpolicyness"
    ):
        load_expr_config(["--config", path], GRPOConfig)


def test_load_wrong_type_names_key_and_expected_type(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    with pytest.raises(ValueError) as info:
        load_expr_config(["--config", path, "actor.optimizer.lr=fast"], GRPOConfig)
    msg = str(info.value)
    assert "actor.optimizer.lr" in msg and "float" in msg
    assert "Traceback" not in msg and len(msg.splitlines()) == 1
    with pytest.raises(ValueError, match=r"gconfig\.n_samples.*int"):
        load_expr_config(["--config", path, "gconfig.n_samples=2.5"], GRPOConfig)


def test_load_scalar_for_section_is_error(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    with pytest.raises(ValueError, match=r"actor\.mb_spec.*section"):
        load_expr_config(["--config", path, "actor.mb_spec=3"], GRPOConfig)


def test_load_validation_error_propagates_as_valueerror(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    with pytest.raises(ValueError, match="max_head_offpolicyness"):
        load_expr_config(["--config", path, "rollout.max_head_offpolicyness=-2"], GRPOConfig)


def test_load_missing_required_key_names_it(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML.replace("trial_name: t0\n", ""))
    with pytest.raises(ValueError, match="trial_name"):
        load_expr_config(["--config", path], GRPOConfig)


def test_load_without_config_flag_raises():
    with pytest.raises(ValueError, match="--config"):
        load_expr_config(["seed=1"], GRPOConfig)
    with pytest.raises(ValueError, match="does not exist"):
        load_expr_config(["--config", "/nonexistent/x.yaml"], GRPOConfig)


def test_load_skips_script_path_and_accepts_config_equals(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    cfg, _ = load_expr_config(["train.py", f"--config={path}", "seed=3"], GRPOConfig)
    assert cfg.seed == 3


def test_load_writes_resolved_config_yaml_to_log_dir(tmp_path):
    path = _write(tmp_path, MINIMAL_GRPO_YAML + "tokenizer_path: ${actor.path}\n")
    cfg, _ = load_expr_config(["--config", path, "actor.optimizer.lr=2e-5"], GRPOConfig)
    log_dir = get_log_path(cfg)
    assert log_dir == os.path.join(str(tmp_path / "root"), "logs", "exp", "t0")
    saved = yaml.safe_load(open(os.path.join(log_dir, "config.yaml")))
    assert saved["tokenizer_path"] == "/models/tiny"  # interpolation resolved
    assert saved["actor"]["optimizer"]["lr"] == pytest.approx(2e-5)
    # the saved file is itself a loadable config giving the same object
    again, _ = load_expr_config(["--config", os.path.join(log_dir, "config.yaml")], GRPOConfig)
    assert again == cfg


def test_load_on_nonzero_rank_does_not_write_config(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    path = _write(tmp_path, MINIMAL_GRPO_YAML)
    cfg, _ = load_expr_config(["--config", path], GRPOConfig)
    assert not os.path.exists(os.path.join(get_log_path(cfg), "config.yaml"))


def test_load_areal_style_grpo_yaml_unchanged(tmp_path):
    path = _write(tmp_path, AREAL_STYLE_GRPO_YAML)
    cfg, _ = load_expr_config(["--config", path], GRPOConfig)
    root = str(tmp_path / "root")
    assert cfg.experiment_name == "math-grpo" and cfg.total_train_epochs == 3
    assert cfg.tokenizer_path == "/models/tiny-qwen"
    assert cfg.rollout.consumer_batch_size == 16 and cfg.rollout.fileroot == root
    assert cfg.rollout.scheduling_spec == cfg.actor.scheduling_spec
    assert cfg.actor.scheduling_spec[0].cmd == "python3 -m some.worker"
    assert cfg.actor.reward_norm.group_size == 8 and cfg.actor.reward_norm.mean_level == "group"
    assert cfg.actor.optimizer.lr == pytest.approx(
        2.5e-6
    ) and cfg.actor.optimizer.eps == pytest.approx(1e-8)
    assert cfg.actor.max_new_tokens == 512 and cfg.actor.behav_imp_weight_cap == 4.0
    assert isinstance(cfg.ref, PPOActorConfig) and cfg.ref.optimizer is None
    assert cfg.ref.dtype == "float32" and cfg.ref.scheduling_strategy.target == "actor"
    assert cfg.sglang.random_seed == 7 and cfg.vllm.model == "/models/tiny-qwen"
    assert cfg.valid_dataset.shuffle is False and cfg.valid_dataset.batch_size == 32
    assert cfg.perf_tracer.session_tracer.enabled is False
    assert cfg.scheduler.type is None and cfg.recover.freq_secs == 1800
    assert isinstance(cfg.gconfig, GenerationHyperparameters) and cfg.gconfig.temperature == 0.9


def test_build_config_sft_section(tmp_path):
    yaml_dict = {
        "experiment_name": "sft",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "train_dataset": {"path": "x.jsonl", "type": "sft"},
        "model": {"path": "m", "dtype": "float32", "optimizer": {"lr_scheduler_type": "cosine"}},
    }
    cfg = build_config(yaml_dict, ["model.num_threads=2"], SFTConfig)
    assert isinstance(cfg.model, TrainEngineConfig) and cfg.model.num_threads == 2
    assert cfg.model.optimizer.lr_scheduler_type == "cosine"
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        build_config(yaml_dict, ["model.optimizer.lr_scheduler_type=step"], SFTConfig)


def test_ppo_config_accepts_critic_section(tmp_path):
    yaml_dict = {
        "experiment_name": "ppo",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "train_dataset": {"path": "x.jsonl", "type": "rl"},
        "critic": {"path": "m", "is_critic": True, "optimizer": {}},
    }
    cfg = build_config(yaml_dict, [], PPOConfig)
    assert isinstance(cfg.critic, PPOCriticConfig) and cfg.critic.eps_clip == 0.5
    assert cfg.critic.experiment_name == "ppo"


def test_yaml_text_block_dedent_is_valid_yaml():
    # guard against accidental indentation damage of the embedded test YAML
    assert yaml.safe_load(textwrap.dedent(AREAL_STYLE_GRPO_YAML))["actor"]["eps_clip"] == 0.2
