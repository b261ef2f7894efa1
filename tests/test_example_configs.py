"""Every YAML under examples/ loads into the config class of the script that runs it.

``load_expr_config`` builds a structured config: an unknown key, a wrong type or a value
that a ``__post_init__`` rejects is an error, so a YAML that drifts from its config class
fails here, not at the start of somebody's run. A new YAML must be added to ``EXAMPLES``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from areal.api import cli_args

ROOT = Path(__file__).resolve().parents[1]

# YAML (relative to examples/) -> (script that runs it, config class name in that script)
EXAMPLES = {
    "agent_workflow/agent_grpo_cpu.yaml": ("agent_workflow/math_agent.py", "GRPOConfig"),
    "agent_workflow/tool_agent_cpu.yaml": ("agent_workflow/tool_agent.py", "GRPOConfig"),
    "alignment/dpo_cpu.yaml": ("alignment/dpo.py", "DPOConfig"),
    "alignment/rw_cpu.yaml": ("alignment/rw.py", "RWConfig"),
    "distillation/gsm8k_grpo_distill_cpu.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_dapo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_drgrpo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_eval_cpu.yaml": ("math/gsm8k_eval.py", "GRPOConfig"),
    "math/gsm8k_grpo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_grpo_cpu.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_grpo_moe_cpu.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_grpo_lora.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_gspo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_liteppo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_m2po.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_ppo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),  # PPOConfig: test_presets.py
    "math/gsm8k_reinforce_pp.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_rloo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_sapo.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "math/gsm8k_sft_cpu.yaml": ("math/gsm8k_sft.py", "SFTConfig"),
    "math/smollm2_grpo_cpu.yaml": ("math/gsm8k_rl.py", "GRPOConfig"),
    "multi_turn_math/gsm8k_grpo_mt_cpu.yaml": (
        "multi_turn_math/gsm8k_rl_mt.py",
        "MultiTurnGRPOConfig",
    ),
    "openclaw/config.yaml": ("openclaw/train.py", "PPOConfig"),
    "tool_task/config_cpu.yaml": ("tool_task/train.py", "GRPOConfig"),
    "vlm/clevr_count_70k_grpo.yaml": ("vlm/clevr_count_grpo.py", "GRPOConfig"),
    "vlm/clevr_count_grpo_cpu.yaml": ("vlm/clevr_count_grpo.py", "GRPOConfig"),
}


def _config_class(script: str, name: str) -> type:
    if hasattr(cli_args, name):
        cls = getattr(cli_args, name)
    else:  # defined by the example script itself
        path = ROOT / "examples" / script
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cls = getattr(module, name)
    # the script really loads this class (a renamed class must not go unnoticed)
    assert "load_expr_config(" in (ROOT / "examples" / script).read_text()
    assert name in (ROOT / "examples" / script).read_text(), (script, name)
    return cls


def test_every_example_yaml_is_listed():
    found = {p.relative_to(ROOT / "examples").as_posix() for p in ROOT.glob("examples/**/*.yaml")}
    assert found == set(EXAMPLES), (sorted(found - set(EXAMPLES)), sorted(set(EXAMPLES) - found))


@pytest.mark.parametrize("yaml_path", sorted(EXAMPLES))
def test_example_yaml_loads_into_its_config_class(yaml_path, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")  # do not write the resolved config
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    script, name = EXAMPLES[yaml_path]
    cls = _config_class(script, name)
    cfg, path = cli_args.load_expr_config(["--config", str(ROOT / "examples" / yaml_path)], cls)
    assert type(cfg) is cls
    assert Path(path).name == Path(yaml_path).name
    assert cfg.experiment_name and cfg.trial_name


def _load(yaml_path, monkeypatch, tmp_path, cls=cli_args.GRPOConfig):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    cfg, _ = cli_args.load_expr_config(["--config", str(ROOT / "examples" / yaml_path)], cls)
    return cfg


def test_distillation_yaml_sets_a_frozen_teacher_that_ships(monkeypatch, tmp_path):
    cfg = _load("distillation/gsm8k_grpo_distill_cpu.yaml", monkeypatch, tmp_path)
    assert cfg.teacher is not None and cfg.teacher.rl_loss_weight == 0.0
    assert (ROOT / cfg.teacher.path / "config.json").is_file()


def test_lora_yaml_enables_lora_on_the_actor(monkeypatch, tmp_path):
    cfg = _load("math/gsm8k_grpo_lora.yaml", monkeypatch, tmp_path)
    assert cfg.actor.use_lora and cfg.actor.lora_rank > 0
