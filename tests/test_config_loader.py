"""Command-line overrides as AReaL's loader takes them, and running a GPU config on CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from areal.api import cli_args
from areal.api.cli_args import GRPOConfig, SFTConfig, build_config, load_expr_config

PARITY = Path(__file__).parent / "fixtures" / "config_parity"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    cli_args._WARNED.clear()
    yield
    cli_args._WARNED.clear()


def _yaml(tmp_path, **extra) -> dict:
    d = {
        "experiment_name": "e",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "train_dataset": {"path": "x.jsonl", "type": "rl"},
        "actor": {"path": "m", "scheduling_spec": [{"cpu": 2, "gpu": 1}, {"cpu": 1, "gpu": 1}]},
    }
    d.update(extra)
    return d


def test_list_index_override_sets_one_item(tmp_path):
    cfg = build_config(
        _yaml(tmp_path),
        ["actor.scheduling_spec.1.gpu=0", "actor.scheduling_spec.0.mem=7"],
        GRPOConfig,
    )
    assert [s.gpu for s in cfg.actor.scheduling_spec] == [1, 0]
    assert cfg.actor.scheduling_spec[0].mem == 7 and cfg.actor.scheduling_spec[0].cpu == 2


def test_list_index_override_into_list_absent_from_yaml_uses_schema_default(tmp_path):
    cfg = build_config(_yaml(tmp_path), ["rollout.scheduling_spec.0.env_vars.A=1"], GRPOConfig)
    spec = cfg.rollout.scheduling_spec[0]
    default = cli_args.InferenceEngineConfig().scheduling_spec[0]
    assert spec.env_vars == {"A": "1"}
    assert (spec.cpu, spec.mem) == (default.cpu, default.mem)


def test_list_index_out_of_range_or_not_a_number_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="index 2 is out of range; the list has 2"):
        build_config(_yaml(tmp_path), ["actor.scheduling_spec.2.gpu=0"], GRPOConfig)
    with pytest.raises(ValueError, match="indexes a list"):
        build_config(_yaml(tmp_path), ["actor.scheduling_spec.first.gpu=0"], GRPOConfig)


def test_plus_forms_and_new_keys(tmp_path):
    cfg = build_config(
        _yaml(tmp_path),
        ["+scheduler.type=local", "++actor.optimizer.lr=3e-4", "+rollout.agent.mode=online"],
        GRPOConfig,
    )
    assert cfg.scheduler.type == "local" and cfg.actor.optimizer.lr == 3e-4
    assert cfg.rollout.agent.mode == "online"
    with pytest.raises(ValueError, match="Unknown config key 'actor.new_knob'"):
        build_config(_yaml(tmp_path), ["+actor.new_knob=1"], GRPOConfig)


def test_tilde_removes_key_back_to_default(tmp_path):
    d = _yaml(tmp_path, gconfig={"temperature": 0.5, "n_samples": 4})
    cfg = build_config(d, ["~gconfig.temperature", "~gconfig.not_there"], GRPOConfig)
    assert cfg.gconfig.temperature == 1.0 and cfg.gconfig.n_samples == 4


def test_values_parsed_as_yaml(tmp_path):
    cfg = build_config(
        _yaml(tmp_path),
        [
            "gconfig.stop=['\\n\\n', '</s>']",
            "gconfig.stop_token_ids=[1,2]",
            "actor.eps_clip_higher=null",
            "actor.reward_norm={mean_level: group, std_level: null}",
            "stats_logger.wandb.notes=",
            "tokenizer_path=${actor.path}",
        ],
        GRPOConfig,
    )
    assert cfg.gconfig.stop_token_ids == [1, 2] and len(cfg.gconfig.stop) == 2
    assert cfg.actor.eps_clip_higher is None
    assert cfg.actor.reward_norm.mean_level == "group" and cfg.actor.reward_norm.std_level is None
    assert cfg.stats_logger.wandb.notes == ""
    assert cfg.tokenizer_path == "m"


def test_override_through_interpolation_is_a_clear_error(tmp_path):
    d = _yaml(tmp_path, rollout={"scheduling_spec": "${actor.scheduling_spec}"})
    with pytest.raises(ValueError, match="is the interpolation"):
        build_config(d, ["rollout.scheduling_spec.0.gpu=0"], GRPOConfig)


def test_override_of_legacy_model_section_lands_in_actor(tmp_path):
    d = {
        "experiment_name": "e",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "train_dataset": {"path": "x", "type": "sft"},
        "model": {"path": "m", "num_threads": 1},
    }
    cfg = build_config(d, ["actor.num_threads=2"], SFTConfig)
    assert cfg.actor.num_threads == 2 and cfg.actor.path == "m"
    cfg = build_config(d, ["model.num_threads=3"], SFTConfig)
    assert cfg.actor.num_threads == 3


def test_load_expr_config_accepts_tilde_and_bad_argument_message(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(_yaml(tmp_path, seed=5)))
    cfg, _ = load_expr_config(["train.py", "--config", str(f), "~seed"], GRPOConfig)
    assert cfg.seed == 1
    with pytest.raises(ValueError, match="~key.sub"):
        load_expr_config(["--config", str(f), "--lr", "1"], GRPOConfig)


# ---------------------------------------------------------------- GPU config on CPU


def test_cpu_override_drops_gpu_requests_with_one_warning(tmp_path, caplog):
    d = _yaml(tmp_path, rollout={"scheduling_spec": [{"gpu": 2}]}, ref={"path": "m"})
    d["actor"]["dtype"] = "bfloat16"
    with caplog.at_level(logging.WARNING, logger="areal"):
        cfg = build_config(d, ["cluster.n_gpus_per_node=0"], GRPOConfig)
    assert [s.gpu for s in cfg.actor.scheduling_spec] == [0, 0]
    assert cfg.rollout.scheduling_spec[0].gpu == 0
    assert cfg.actor.dtype == "float32" and cfg.ref.dtype == "float32"
    gpu_lines = [r for r in caplog.records if "GPU requests dropped" in r.getMessage()]
    assert len(gpu_lines) == 1
    msg = gpu_lines[0].getMessage()
    assert "actor.scheduling_spec.0.gpu=1" in msg and "rollout.scheduling_spec.0.gpu=2" in msg
    assert "actor.dtype=bfloat16" in caplog.text and "mapped to float32" in caplog.text


def test_gpu_cluster_keeps_gpu_requests_and_dtype(tmp_path):
    d = _yaml(tmp_path)
    d["actor"]["dtype"] = "bfloat16"
    cfg = build_config(d, [], GRPOConfig)
    assert [s.gpu for s in cfg.actor.scheduling_spec] == [1, 1]
    assert cfg.actor.dtype == "bfloat16"


def test_gpu_fixture_runs_on_cpu_with_overrides_only():
    # A GPU-style config of our own (every AReaL-example key set) made CPU-runnable on
    # the command line only.
    cfg, _ = load_expr_config(
        [
            "--config",
            str(PARITY / "rl.yaml"),
            "cluster.n_gpus_per_node=0",
            "allocation_mode=local:d1+fsdp:d1",
            "actor.backend=fsdp:d1",
            "rollout.backend=local:d1",
            "actor.scheduling_spec.0.cpu=1",
        ],
        GRPOConfig,
    )
    for _, obj in cli_args._walk_dataclasses(cfg):
        if isinstance(obj, cli_args.SchedulingSpec):
            assert obj.gpu == 0
        if isinstance(obj, cli_args.TrainEngineConfig):
            assert obj.dtype == "float32"
    assert cfg.actor.scheduling_spec[0].cpu == 1


def _write(path: Path, data: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_hydra_defaults_list_is_composed_own_values_win(tmp_path):
    """AReaL loads YAMLs through Hydra: a ``defaults:`` list (AReaL 2.0's DTE example)
    composes other files first; the file's own keys win unless ``_self_`` comes first."""
    base = _yaml(tmp_path, seed=1, total_train_steps=5)
    base["actor"]["optimizer"] = {"lr": 1e-5, "weight_decay": 0.05}
    _write(tmp_path / "math" / "base.yaml", base)
    # a config group lives in the search path: the primary config's folder
    _write(tmp_path / "dte" / "opt" / "fast.yaml", {"lr": 3e-4, "warmup_steps_proportion": 0.2})
    child = tmp_path / "dte" / "child.yaml"
    _write(
        child,
        {
            "defaults": ["../math/base@_global_", {"opt@actor.optimizer": "fast"}],
            "seed": 42,
            "actor": {"path": "mine"},
        },
    )
    cfg, path = load_expr_config(["--config", str(child), "total_train_steps=7"], GRPOConfig)
    assert path == str(child)
    assert cfg.seed == 42 and cfg.actor.path == "mine"  # own values over the defaults
    opt = cfg.actor.optimizer
    assert cfg.experiment_name == "e" and opt.weight_decay == 0.05  # from base
    assert opt.lr == 3e-4 and opt.warmup_steps_proportion == 0.2  # the group, merged later
    assert cfg.total_train_steps == 7  # overrides last
    # _self_ first: the defaults win over the file's own keys
    first = _write(
        tmp_path / "dte" / "first.yaml",
        {"defaults": ["_self_", "../math/base@_global_"], "seed": 42},
    )
    assert load_expr_config(["--config", first], GRPOConfig)[0].seed == 1


def test_hydra_defaults_errors_name_the_file_and_entry(tmp_path):
    base = _write(tmp_path / "base.yaml", _yaml(tmp_path))
    missing = _write(tmp_path / "m.yaml", {"defaults": ["nope@_global_"], "seed": 1})
    with pytest.raises(ValueError, match=r"m.yaml: defaults entry 'nope@_global_'.*nope.yaml"):
        load_expr_config(["--config", missing], GRPOConfig)
    optional = _write(
        tmp_path / "o.yaml", {"defaults": ["base@_global_", {"optional extra": "gone"}], "seed": 3}
    )
    assert load_expr_config(["--config", optional], GRPOConfig)[0].seed == 3
    _write(tmp_path / "a.yaml", {"defaults": ["b@_global_"]})
    cyc = _write(tmp_path / "b.yaml", {"defaults": ["a@_global_"]})
    with pytest.raises(ValueError, match=r"cycle: .*b.yaml -> .*a.yaml -> .*b.yaml"):
        load_expr_config(["--config", cyc], GRPOConfig)
    bad = _write(tmp_path / "bad.yaml", {"defaults": [{"a": 1, "b": 2}]})
    with pytest.raises(ValueError, match="not a Hydra defaults entry"):
        load_expr_config(["--config", bad], GRPOConfig)
    assert base
