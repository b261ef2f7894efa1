"""Every algorithm preset in examples/math loads and sets the fields that define it."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.api import cli_args

ROOT = Path(__file__).resolve().parents[1]
PRESETS = [
    "gsm8k_grpo",
    "gsm8k_ppo",
    "gsm8k_dapo",
    "gsm8k_drgrpo",
    "gsm8k_liteppo",
    "gsm8k_rloo",
    "gsm8k_reinforce_pp",
    "gsm8k_gspo",
    "gsm8k_sapo",
    "gsm8k_m2po",
]


def _load(name, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")  # do not write the resolved config
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    cls = cli_args.PPOConfig if name == "gsm8k_ppo" else cli_args.GRPOConfig
    cfg, path = cli_args.load_expr_config(
        ["--config", str(ROOT / "examples/math" / f"{name}.yaml")], cls
    )
    assert Path(path).name == f"{name}.yaml"
    return cfg


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_with_portable_paths_and_doc(name, monkeypatch, tmp_path):
    monkeypatch.setenv("GSM8K_PATH", "/somewhere/gsm8k")
    monkeypatch.setenv("MODEL_PATH", "/models/qwen")
    cfg = _load(name, monkeypatch, tmp_path)
    assert cfg.train_dataset.path == "/somewhere/gsm8k"
    assert cfg.actor.path == "/models/qwen" and cfg.tokenizer_path == "/models/qwen"
    assert cfg.actor.group_size == cfg.gconfig.n_samples
    assert (ROOT / "docs" / "algorithms" / f"{name.removeprefix('gsm8k_')}.md").is_file()


def test_preset_paths_default_relative_when_env_unset(monkeypatch, tmp_path):
    monkeypatch.delenv("GSM8K_PATH", raising=False)
    monkeypatch.delenv("MODEL_PATH", raising=False)
    cfg = _load("gsm8k_grpo", monkeypatch, tmp_path)
    assert cfg.train_dataset.path == "data/gsm8k"
    assert not Path(cfg.actor.path).is_absolute()


def test_preset_key_fields(monkeypatch, tmp_path):
    c = {n: _load(n, monkeypatch, tmp_path).actor for n in PRESETS}
    ppo = _load("gsm8k_ppo", monkeypatch, tmp_path)
    assert (
        ppo.critic is not None and ppo.critic.is_critic and ppo.actor.adv_norm.mean_level == "batch"
    )
    assert (
        c["gsm8k_grpo"].reward_norm.mean_level == "group"
        and c["gsm8k_grpo"].reward_norm.std_level == "group"
    )
    assert c["gsm8k_grpo"].use_decoupled_loss
    d = c["gsm8k_dapo"]
    assert d.eps_clip_higher > d.eps_clip and d.dynamic_sampling and d.overlong_reward_penalty
    assert d.loss_agg_mode == "token-mean"
    dr = c["gsm8k_drgrpo"]
    assert dr.reward_norm.std_level is None and dr.loss_agg_mode == "seq-mean-token-sum-norm"
    assert dr.loss_norm_constant == 1024
    lite = c["gsm8k_liteppo"]
    assert lite.reward_norm.mean_level == "group" and lite.reward_norm.std_level == "batch"
    rloo = c["gsm8k_rloo"]
    assert rloo.reward_norm.mean_leave1out and rloo.reward_norm.std_level is None
    rpp = _load("gsm8k_reinforce_pp", monkeypatch, tmp_path)
    assert rpp.actor.kl_ctl > 0 and rpp.ref is not None and rpp.actor.reward_norm is None
    assert rpp.actor.adv_norm.mean_level == "batch" and rpp.actor.adv_norm.std_level == "batch"
    assert c["gsm8k_gspo"].importance_sampling_level == "sequence"
    assert c["gsm8k_sapo"].use_sapo_loss and not c["gsm8k_sapo"].use_decoupled_loss
    assert c["gsm8k_m2po"].m2_threshold == pytest.approx(0.04)
    for name in PRESETS:
        if name not in ("gsm8k_sapo",):
            assert not c[name].use_sapo_loss
        if name != "gsm8k_m2po":
            assert c[name].m2_threshold is None
