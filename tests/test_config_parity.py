"""Schema parity with AReaL's example YAMLs, on configs of our own writing.

``tests/fixtures/config_parity/areal_yaml_keys.txt`` lists every key that AReaL's
published example YAMLs set (per config class; the examples needing Megatron, Archon or
NPUs left out). The fixtures next to it set each of those keys to a non-default value;
these tests check that every value lands in the dataclasses, that the deprecated keys
are migrated with a warning, and that settings accepted but not acted on are warned about.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from areal.api import cli_args
from areal.api.cli_args import (
    DPOConfig,
    GRPOConfig,
    RejectionSamplingConfig,
    RWConfig,
    SFTConfig,
    load_expr_config,
    not_acted_on_settings,
)

FIXTURES = Path(__file__).parent / "fixtures" / "config_parity"
CLASSES = {
    "GRPOConfig": GRPOConfig,
    "SFTConfig": SFTConfig,
    "RWConfig": RWConfig,
    "DPOConfig": DPOConfig,
}
FILES = {
    "GRPOConfig": ["rl.yaml", "rl_variants.yaml"],
    "SFTConfig": ["sft.yaml"],
    "RWConfig": ["rw.yaml"],
    "DPOConfig": ["dpo.yaml"],
}


@pytest.fixture(autouse=True)
def _no_side_effects(monkeypatch):
    monkeypatch.setenv("RANK", "1")  # load only: no resolved config.yaml written
    cli_args._WARNED.clear()
    yield
    cli_args._WARNED.clear()


def _leaves(node, prefix=""):
    """(dotted path, value) of every leaf of a YAML mapping; list items as '.0.'."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
        for i, item in enumerate(node):
            yield from _leaves(item, f"{prefix}{i}.")
    else:
        yield prefix[:-1], node


def _get(obj, dotted):
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _load(cls_name, file_name):
    cfg, _ = load_expr_config(["--config", str(FIXTURES / file_name)], CLASSES[cls_name])
    return cfg


@pytest.mark.parametrize(
    "cls_name, file_name", [(c, f) for c, files in FILES.items() for f in files]
)
def test_fixture_values_land_in_dataclasses(cls_name, file_name):
    raw = yaml.safe_load((FIXTURES / file_name).read_text())
    cfg = _load(cls_name, file_name)
    assert isinstance(cfg, CLASSES[cls_name])
    checked = 0
    for path, value in _leaves(raw):
        if isinstance(value, str) and value.startswith("${"):
            continue
        if path == "actor.behav_imp_weight_cap":  # overridden by the later spelling
            continue
        if path.startswith("rollout.openai."):
            path = path.replace("rollout.openai.", "rollout.agent.", 1)
        got = _get(cfg, path)
        if isinstance(got, tuple):
            got = list(got)
        assert got == value, f"{file_name}: {path} = {got!r}, YAML says {value!r}"
        checked += 1
    assert checked > 10


def test_fixtures_cover_every_key_of_areal_example_yamls():
    covered: dict[str, set[str]] = {}
    for cls_name, files in FILES.items():
        for f in files:
            raw = yaml.safe_load((FIXTURES / f).read_text())
            covered.setdefault(cls_name, set()).update(p for p, _ in _leaves(raw))
    missing = []
    for line in (FIXTURES / "areal_yaml_keys.txt").read_text().splitlines():
        cls_name, key = line.split()
        if key not in covered[cls_name]:
            missing.append(line)
    assert not missing, f"keys used by AReaL example YAMLs that no fixture sets: {missing}"


def test_interpolated_list_section_resolves():
    cfg = _load("GRPOConfig", "rl.yaml")
    assert cfg.critic.scheduling_spec == cfg.actor.scheduling_spec
    assert cfg.critic.scheduling_spec[0].cpu == _get(cfg, "actor.scheduling_spec.0.cpu")


def test_legacy_keys_migrate_with_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="areal"):
        cfg = _load("GRPOConfig", "rl_variants.yaml")
    # behave_imp_weight_cap (the later spelling) wins over behav_imp_weight_cap
    assert cfg.actor.rejection_sampling == RejectionSamplingConfig(
        level="token", action="clamp", metric="ratio", upper=4.0, lower=0.0
    )
    assert cfg.rollout.agent.mode == "subproc" and cfg.rollout.agent.tool_call_parser == "hermes"
    text = caplog.text
    assert "deprecated; migrated to rejection_sampling" in text
    assert "rollout.openai is deprecated" in text
    assert "use_decoupled_loss=False" in text  # rejection sampling without the decoupled loss


def test_not_acted_on_settings_warned_once_per_run(caplog):
    with caplog.at_level(logging.WARNING, logger="areal"):
        cfg = _load("GRPOConfig", "rl.yaml")
        _load("GRPOConfig", "rl.yaml")
    paths = dict(not_acted_on_settings(cfg))
    for expected in ("gconfig.lora_name", "rollout.use_lora", "enable_offload"):
        assert expected in paths
    # acted on now: LoRA training/sync (issue 15), the agent section (issue 13)
    for acted in ("actor.use_lora", "actor.lora_rank", "rollout.agent", "vllm.enable_lora"):
        assert acted not in paths
    assert "LoRA" in paths["rollout.use_lora"]
    assert caplog.text.count("accepted but not acted on") == 1
    assert "rollout.use_lora (needs per-request LoRA" in caplog.text


def test_default_config_has_no_not_acted_on_settings():
    cfg = GRPOConfig(experiment_name="e", trial_name="t")
    assert not_acted_on_settings(cfg) == []


def test_not_acted_on_list_names_existing_fields():
    import dataclasses

    for owner, field_name, why in cli_args.NOT_ACTED_ON:
        cls = getattr(cli_args, owner)
        assert field_name in {f.name for f in dataclasses.fields(cls)}, (owner, field_name)
        assert why


def test_unknown_key_still_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    raw = yaml.safe_load((FIXTURES / "sft.yaml").read_text())
    raw["actor"]["lora_rnak"] = 8
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="Unknown config key 'actor.lora_rnak'.*actor.lora_rank"):
        load_expr_config(["--config", str(bad)], SFTConfig)


@pytest.mark.parametrize("file_name", ["rl.yaml", "rl_variants.yaml"])
def test_saved_resolved_config_loads_back_equal(tmp_path, file_name):
    cfg = _load("GRPOConfig", file_name)
    saved = cli_args.save_config(cfg, str(tmp_path))
    again, _ = load_expr_config(["--config", saved], GRPOConfig)
    assert again == cfg


def _load_checker():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "check_areal_configs.py"
    spec = importlib.util.spec_from_file_location("check_areal_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checker_resolves_classes_excludes_and_reports(tmp_path):
    ex = tmp_path / "examples"
    (ex / "math").mkdir(parents=True)
    (ex / "agent").mkdir()
    (ex / "cloud").mkdir()
    base = "experiment_name: e\ntrial_name: t\ntrain_dataset: {path: p, type: rl}\n"
    (ex / "math" / "train.py").write_text(
        "config, _ = load_expr_config(args, GRPOConfig)\n"
        "config, _ = load_expr_config(args, SFTConfig)\n"
    )
    (ex / "math" / "grpo.yaml").write_text(base + "actor: {rejection_sampling: {upper: 3.0}}\n")
    (ex / "math" / "my_sft.yaml").write_text(base + "actor: {path: m}\n")
    (ex / "math" / "big_megatron.yaml").write_text(
        base + "actor: {backend: 'megatron:d4', weight_update_mode: awex, "
        "megatron: {enable_chunked_logits: true}}\npost_exit_hook: 'echo done'\n"
    )
    (ex / "math" / "kpop_cispo.yaml").write_text(
        base + "actor: {use_cispo_loss: true, eps_clip_higher: 4.0, use_decoupled_loss: true, "
        "rejection_sampling: {metric: binary_kl, upper: 2.0}, "
        "prox_logp_method: reuse_train_logp}\n"
        "teacher: {engine_type: rollout, path: t, rollout: {backend: 'vllm:d1p1t2'}}\n"
    )
    (ex / "math" / "broken.yaml").write_text(base + "actor: {no_such_key: 1}\n")
    (ex / "agent" / "configs.py").write_text(
        "from dataclasses import dataclass, field\n"
        "from areal.api.cli_args import GRPOConfig\n\n\n"
        "@dataclass\nclass MyAgentConfig(GRPOConfig):\n"
        "    max_turns: int = field(default=4, metadata={'help': 'turns'})\n"
    )
    (ex / "agent" / "train.py").write_text(
        "from configs import MyAgentConfig\nconfig, _ = load_expr_config(args, MyAgentConfig)\n"
    )
    (ex / "agent" / "config.yaml").write_text(base + "max_turns: 9\n")
    (ex / "cloud" / "cluster.sky.yaml").write_text("resources: {cloud: aws}\n")
    report = _load_checker().check(ex)
    loaded = {item["path"]: item["class"] for item in report["loaded"]}
    assert loaded == {
        "math/grpo.yaml": "GRPOConfig",
        "math/my_sft.yaml": "SFTConfig",
        "math/big_megatron.yaml": "GRPOConfig",
        "math/kpop_cispo.yaml": "GRPOConfig",
        "agent/config.yaml": "MyAgentConfig",
    }
    # AReaL 2.0 Megatron YAML: loads (runs on archon), its Megatron-only settings listed
    megatron = next(i for i in report["loaded"] if i["path"] == "math/big_megatron.yaml")
    assert megatron["not_acted_on"] == ["actor.megatron"]  # post_exit_hook: the launchers run it
    assert [f["path"] for f in report["failed"]] == ["math/broken.yaml"]
    assert "actor.no_such_key" in report["failed"][0]["error"]
    reasons = {e["path"]: e["reason"] for e in report["excluded"]}
    assert "SkyPilot" in reasons["cloud/cluster.sky.yaml"]
    assert report["counts"] == {"total": 7, "loaded": 5, "failed": 1, "excluded": 1}
