"""AReaL-parity config fields: rejection sampling (and its legacy migration), packing
algorithm, agent / DPO / SFT sections, generation helpers, server command builders."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from areal.api import cli_args
from areal.api.cli_args import (
    AgentConfig,
    DPOConfig,
    DPOEngineConfig,
    EvaluatorConfig,
    GenerationHyperparameters,
    GRPOConfig,
    MicroBatchSpec,
    PPOActorConfig,
    RejectionSamplingConfig,
    RWConfig,
    SFTConfig,
    SGLangConfig,
    TrainDatasetConfig,
    ValidDatasetConfig,
    build_config,
    get_py_cmd,
    legacy_rejection_sampling,
    vLLMConfig,
)


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    """Each test sees the once-per-process warnings afresh."""
    cli_args._WARNED.clear()
    yield
    cli_args._WARNED.clear()


def _base(tmp_path, **extra) -> dict:
    d = {
        "experiment_name": "e",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "train_dataset": {"path": "x.jsonl", "type": "rl"},
    }
    d.update(extra)
    return d


# ---------------------------------------------------------------- rejection sampling


def test_rejection_sampling_defaults_match_areal():
    rs = RejectionSamplingConfig()
    assert (rs.level, rs.action, rs.metric, rs.agg, rs.upper, rs.lower) == (
        "token",
        "mask",
        "ratio",
        "mean",
        5.0,
        None,
    )
    assert PPOActorConfig().rejection_sampling is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"level": "batch"}, "level"),
        ({"action": "drop"}, "action"),
        ({"metric": "kl_k4"}, "metric"),
        ({"agg": "median", "level": "sequence"}, "agg"),
        ({"upper": 1.0}, "upper"),
        ({"lower": 0.0}, "lower"),
        ({"lower": 6.0}, "lower"),
        ({"metric": "kl_k3", "upper": 0.0}, "upper"),
        ({"metric": "kl_k2", "action": "clamp", "upper": 1.0}, "action"),
    ],
)
def test_rejection_sampling_invalid_value_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"RejectionSamplingConfig.{field}="):
        RejectionSamplingConfig(**kwargs)


def test_rejection_sampling_clamp_sets_lower_zero_and_kl_k1_allows_negative_bounds():
    assert RejectionSamplingConfig(action="clamp").lower == 0.0
    rs = RejectionSamplingConfig(metric="kl_k1", upper=0.5, lower=-0.5, level="sequence", agg="max")
    assert (rs.lower, rs.upper, rs.agg) == (-0.5, 0.5, "max")


def test_rejection_sampling_token_level_with_agg_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="areal"):
        RejectionSamplingConfig(level="token", agg="sum")
    assert "agg='sum' is ignored" in caplog.text


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mask", ("token", "mask", None)),
        ("token_truncate", ("token", "clamp", 0.0)),
        ("sequence_mask", ("sequence", "mask", None)),
        ("sequence_truncate", ("sequence", "clamp", 0.0)),
    ],
)
def test_legacy_mode_maps_to_rejection_sampling(mode, expected):
    rs = legacy_rejection_sampling(3.0, mode)
    assert (rs.level, rs.action, rs.lower) == expected
    assert rs.metric == "ratio" and rs.upper == 3.0


def test_legacy_disabled_or_no_cap_maps_to_none():
    assert legacy_rejection_sampling(3.0, "disabled") is None
    assert legacy_rejection_sampling(None, "token_truncate") is None


def test_legacy_yaml_keys_migrate_with_deprecation_warning(tmp_path, caplog):
    yaml_dict = _base(
        tmp_path,
        actor={
            "use_decoupled_loss": True,
            "behave_imp_weight_cap": 4.0,
            "behave_imp_weight_mode": "sequence_truncate",
        },
    )
    with caplog.at_level(logging.WARNING, logger="areal"):
        cfg = build_config(yaml_dict, [], GRPOConfig)
    rs = cfg.actor.rejection_sampling
    assert isinstance(rs, RejectionSamplingConfig)
    assert (rs.level, rs.action, rs.metric, rs.upper, rs.lower) == (
        "sequence",
        "clamp",
        "ratio",
        4.0,
        0.0,
    )
    assert "deprecated" in caplog.text and "rejection_sampling" in caplog.text


def test_legacy_old_spelling_migrates_and_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="areal"):
        a = PPOActorConfig(behav_imp_weight_cap=5.0, use_decoupled_loss=True)
        b = PPOActorConfig(behav_imp_weight_cap=5.0, use_decoupled_loss=True)
    assert a.rejection_sampling == b.rejection_sampling == RejectionSamplingConfig(upper=5.0)
    assert caplog.text.count("deprecated") == 1


def test_legacy_and_new_disagreeing_raises():
    with pytest.raises(ValueError, match="disagree"):
        PPOActorConfig(
            behav_imp_weight_cap=5.0, rejection_sampling=RejectionSamplingConfig(upper=2.0)
        )
    # agreeing values (e.g. a config object rebuilt from its own fields) are fine
    cfg = PPOActorConfig(
        behav_imp_weight_cap=5.0, rejection_sampling=RejectionSamplingConfig(upper=5.0)
    )
    assert cfg.rejection_sampling.upper == 5.0


def test_rejection_sampling_yaml_section_lands_in_dataclass(tmp_path):
    yaml_dict = _base(
        tmp_path,
        actor={
            "use_decoupled_loss": True,
            "rejection_sampling": {
                "level": "sequence",
                "metric": "kl_k3",
                "agg": "max",
                "upper": 1.5,
            },
        },
    )
    cfg = build_config(yaml_dict, ["actor.rejection_sampling.lower=0.1"], GRPOConfig)
    rs = cfg.actor.rejection_sampling
    assert (rs.level, rs.action, rs.metric, rs.agg, rs.upper, rs.lower) == (
        "sequence",
        "mask",
        "kl_k3",
        "max",
        1.5,
        0.1,
    )
    assert cfg.actor.recompute_logprob is True


def test_rejection_sampling_without_decoupled_loss_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="areal"):
        PPOActorConfig(rejection_sampling=RejectionSamplingConfig())
    assert "use_decoupled_loss=False" in caplog.text


def test_prox_logp_method_choices():
    assert PPOActorConfig(prox_logp_method="loglinear", use_decoupled_loss=True).prox_logp_method
    with pytest.raises(ValueError, match="prox_logp_method"):
        PPOActorConfig(prox_logp_method="interpolate")
    cfg = PPOActorConfig(prox_logp_method="loglinear", use_decoupled_loss=True)
    assert cfg.should_compute_prox_logp() is False
    assert PPOActorConfig(use_decoupled_loss=True).should_compute_prox_logp() is True


# ---------------------------------------------------------------- other new fields


def test_packing_algorithm_values_and_new_keeps_it():
    assert MicroBatchSpec().packing_algorithm == "ffd"
    spec = MicroBatchSpec(packing_algorithm="kk", max_tokens_per_mb=64)
    assert MicroBatchSpec.new(spec, n_mbs=3).packing_algorithm == "kk"
    with pytest.raises(ValueError, match="MicroBatchSpec.packing_algorithm='lpt'"):
        MicroBatchSpec(packing_algorithm="lpt")


def test_dataset_split_and_kwargs_defaults_and_yaml(tmp_path):
    assert TrainDatasetConfig(path="p", type="rl").split == "train"
    assert ValidDatasetConfig(path="p", type="rl").split == "test"
    yaml_dict = _base(tmp_path)
    yaml_dict["train_dataset"].update(split="validation", dataset_kwargs={"subset": "main", "n": 3})
    cfg = build_config(yaml_dict, ["train_dataset.dataset_kwargs.seed=7"], GRPOConfig)
    assert cfg.train_dataset.split == "validation"
    assert cfg.train_dataset.dataset_kwargs == {"subset": "main", "n": 3, "seed": 7}


def test_eval_before_train_and_dynamic_bs(tmp_path):
    assert EvaluatorConfig().eval_before_train is False
    cfg = build_config(
        _base(tmp_path, evaluator={"eval_before_train": True}, dynamic_bs=True), [], GRPOConfig
    )
    assert cfg.evaluator.eval_before_train is True and cfg.dynamic_bs is True


def test_rollout_agent_section(tmp_path):
    agent = {
        "agent_cls_path": "my_pkg.agent.MathAgent",
        "mode": "subproc",
        "tool_call_parser": "hermes",
        "export_style": "concat",
        "turn_discount": 0.9,
        "subproc_max_workers": 2,
        "set_reward_finish_timeout": 1.5,
        "scheduling_spec": [{"cpu": 2, "env_vars": {"A": "1"}}],
    }
    cfg = build_config(_base(tmp_path, rollout={"agent": agent}), [], GRPOConfig)
    a = cfg.rollout.agent
    assert isinstance(a, AgentConfig)
    assert (a.agent_cls_path, a.mode, a.export_style, a.turn_discount) == (
        "my_pkg.agent.MathAgent",
        "subproc",
        "concat",
        0.9,
    )
    assert a.scheduling_spec[0].cpu == 2 and a.scheduling_spec[0].env_vars == {"A": "1"}
    with pytest.raises(ValueError, match="AgentConfig.mode='remote'"):
        build_config(_base(tmp_path, rollout={"agent": {"mode": "remote"}}), [], GRPOConfig)
    with pytest.raises(ValueError, match="exactly 1"):
        AgentConfig(scheduling_spec=[])


def test_rollout_openai_section_moves_to_agent_with_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="areal"):
        cfg = build_config(
            _base(tmp_path, rollout={"openai": {"mode": "online", "turn_discount": 0.5}}),
            [],
            GRPOConfig,
        )
    assert cfg.rollout.agent.mode == "online" and cfg.rollout.agent.turn_discount == 0.5
    assert "rollout.openai is deprecated" in caplog.text


def test_sft_actor_section_and_legacy_model_section(tmp_path, caplog):
    base = _base(tmp_path, tokenizer_path="${actor.path}")
    cfg = build_config({**base, "actor": {"path": "m1"}}, ["actor.dtype=float32"], SFTConfig)
    assert cfg.actor.path == "m1" and cfg.actor.dtype == "float32"
    assert cfg.model is cfg.actor and cfg.tokenizer_path == "m1"
    legacy = _base(tmp_path, tokenizer_path="${model.path}", model={"path": "m2"})
    with caplog.at_level(logging.WARNING, logger="areal"):
        cfg = build_config(legacy, ["model.num_threads=2"], SFTConfig)
    assert cfg.actor.path == "m2" and cfg.actor.num_threads == 2 and cfg.tokenizer_path == "m2"
    assert "`model` section is deprecated" in caplog.text


def test_rw_config_requires_critic(tmp_path):
    with pytest.raises(ValueError, match="is_critic"):
        build_config(_base(tmp_path, actor={"path": "m"}), [], RWConfig)
    cfg = build_config(_base(tmp_path, actor={"path": "m", "is_critic": True}), [], RWConfig)
    assert cfg.actor.is_critic


def test_dpo_config_sections(tmp_path):
    yaml_dict = _base(
        tmp_path,
        actor={"path": "m", "beta": 0.2, "loss_type": "ipo", "optimizer": {"lr": 1e-6}},
        ref={"path": "m"},
    )
    cfg = build_config(yaml_dict, [], DPOConfig)
    assert isinstance(cfg.actor, DPOEngineConfig) and isinstance(cfg.ref, DPOEngineConfig)
    assert (cfg.actor.beta, cfg.actor.loss_type, cfg.ref.beta) == (0.2, "ipo", 0.1)
    with pytest.raises(ValueError, match="loss_type"):
        DPOEngineConfig(loss_type="hinge")
    with pytest.raises(ValueError, match="is_critic"):
        build_config(_base(tmp_path, actor={"is_critic": True}), [], DPOConfig)


# ---------------------------------------------------------------- generation helpers


def test_new_with_stop_and_pad_token_ids_appends_once():
    g = GenerationHyperparameters(stop_token_ids=[7, 2])
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    out = g.new_with_stop_and_pad_token_ids(tok)
    assert out.stop_token_ids == [7, 2, 0] and g.stop_token_ids == [7, 2]
    no_pad = GenerationHyperparameters().new_with_stop_and_pad_token_ids(
        SimpleNamespace(pad_token_id=None, eos_token_id=5)
    )
    assert no_pad.stop_token_ids == [5]


@pytest.mark.parametrize(
    "api_format, key",
    [
        ("completions", "max_completion_tokens"),
        ("responses", "max_output_tokens"),
        ("openai-agents", "max_tokens"),
    ],
)
def test_to_openai_args_dict_renames_and_drops(api_format, key):
    g = GenerationHyperparameters(n_samples=4, max_new_tokens=64, temperature=0.7, stop=["\n"])
    d = g.to_openai_args_dict(api_format=api_format)
    assert d == {
        "n": 4,
        key: 64,
        "top_p": 1.0,
        "temperature": 0.7,
        "stop": ["\n"],
        "frequency_penalty": 0.0,
    }


def test_to_openai_args_dict_warns_on_dropped_non_default_and_excludes(caplog):
    g = GenerationHyperparameters(top_k=5, greedy=True)
    with caplog.at_level(logging.WARNING, logger="areal"):
        d = g.to_openai_args_dict(exclude_args=["stop", "frequency_penalty"])
    assert "top_k" in caplog.text and "greedy" in caplog.text
    assert "min_new_tokens" not in caplog.text  # default value: dropped silently
    assert set(d) == {"n", "max_completion_tokens", "top_p", "temperature"}
    assert g.to_openai_completions_args_dict() == g.to_openai_args_dict()
    assert "max_output_tokens" in g.to_openai_responses_args_dict()
    assert "max_tokens" in g.to_openai_agents_model_settings_dict()
    with pytest.raises(ValueError, match="api_format='chat'"):
        g.to_openai_args_dict(api_format="chat")


# ---------------------------------------------------------------- server commands


def _flag_value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_get_py_cmd_flag_rules():
    cmd = get_py_cmd(
        "m.n",
        {"a_b": 1, "on": True, "off": False, "none": None, "empty": "", "lst": [1, 2], "nil": []},
    )
    assert cmd == ["python3", "-m", "m.n", "--a-b", "1", "--on", "--lst", "1", "2"]


def test_vllm_build_cmd_flags():
    cfg = vLLMConfig(model="/m", dtype="float32", enforce_eager=True, max_model_len=2048)
    cmd = vLLMConfig.build_cmd(cfg, tp_size=2, pp_size=1, host="127.0.0.1", port=9000)
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag_value(cmd, "--model") == "/m" and _flag_value(cmd, "--tokenizer") == "/m"
    assert _flag_value(cmd, "--tensor-parallel-size") == "2"
    assert _flag_value(cmd, "--pipeline-parallel-size") == "1"
    assert _flag_value(cmd, "--dtype") == "float32"
    assert _flag_value(cmd, "--max-model-len") == "2048"
    assert _flag_value(cmd, "--host") == "127.0.0.1" and _flag_value(cmd, "--port") == "9000"
    assert "--enforce-eager" in cmd and "--no-enable-prefix-caching" in cmd
    assert "--trust-remote-code" in cmd and "--enable-lora" not in cmd
    assert "--worker-extension-cls" not in cmd  # empty string: left out
    assert "--nnodes" not in cmd and "--headless" not in cmd


def test_vllm_build_args_multi_node():
    cfg = vLLMConfig(model="/m")
    a0 = vLLMConfig.build_args(cfg, 4, 2, dist_init_addr="10.0.0.1:29500", n_nodes=2)
    assert (a0["nnodes"], a0["node_rank"], a0["master_addr"], a0["master_port"]) == (
        2,
        0,
        "10.0.0.1",
        "29500",
    )
    assert "headless" not in a0
    a1 = vLLMConfig.build_args(cfg, 4, 2, dist_init_addr="10.0.0.1:29500", n_nodes=2, node_rank=1)
    assert a1["headless"] is True


def test_sglang_build_cmd_flags():
    cfg = SGLangConfig(model_path="/m", dtype="float16", context_length=4096, random_seed=3)
    cmd = SGLangConfig.build_cmd(cfg, tp_size=2, base_gpu_id=1, host="127.0.0.1", port=30000)
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    assert _flag_value(cmd, "--model-path") == "/m"
    assert _flag_value(cmd, "--tokenizer-path") == "/m"
    assert _flag_value(cmd, "--tp-size") == "2" and _flag_value(cmd, "--base-gpu-id") == "1"
    assert _flag_value(cmd, "--dtype") == "float16"
    assert _flag_value(cmd, "--context-length") == "4096"
    assert _flag_value(cmd, "--random-seed") == "3"
    assert _flag_value(cmd, "--port") == "30000"
    assert "--disable-radix-cache" in cmd and "--trust-remote-code" in cmd
    assert "--pp-size" not in cmd and "--dist-init-addr" not in cmd
    assert "--model-loader-extra-config" not in cmd


def test_sglang_build_args_multithread_load_and_pp():
    cfg = SGLangConfig(model_path="/m", enable_multithread_load=True)
    args = SGLangConfig.build_args(cfg, 1, 0, pp_size=2, dist_init_addr="h:1", n_nodes=2)
    assert "enable_multithread_load" not in args
    assert json.loads(args["model_loader_extra_config"]) == {"enable_multithread_load": True}
    assert args["pp_size"] == 2 and args["dist_init_addr"] == "h:1" and args["nnodes"] == 2
    cmd = SGLangConfig.build_cmd_from_args(args, python="/venv/bin/python")
    assert cmd[0] == "/venv/bin/python"
