"""Every algorithm preset runs 2 training steps on the tiny model (CPU, 1 server + 1 worker).

The presets are GPU configurations; the overrides below move them onto this machine
without touching what defines each algorithm (losses, normalisation, critic, KL, filters).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_presets import PRESETS  # the one list of presets

from areal.api import cli_args

ROOT = Path(__file__).resolve().parents[1]


def _cpu_overrides(tmp_path, loader_workers: int = 0) -> list[str]:
    return [
        f"cluster.fileroot={tmp_path}",
        "cluster.n_gpus_per_node=0",
        "allocation_mode=local:d1+fsdp:d1",
        "scheduler.type=local",
        "total_train_steps=2",
        "train_dataset.path=synthetic://arith?n=256&seed=11",
        "train_dataset.batch_size=4",
        "train_dataset.max_length=null",
        # The presets' 4 dataloader processes (spawned, each importing torch) cost ~8 s
        # before the first batch on 2 cores: the first preset runs the multi-process
        # loader path with one, the others load in the controller.
        f"train_dataset.num_workers={loader_workers}",
        "valid_dataset=null",
        "gconfig.n_samples=4",
        "gconfig.max_new_tokens=16",
        "actor.dtype=float32",
        "actor.attn_impl=sdpa",
        "actor.gradient_checkpointing=false",
        "actor.mb_spec.max_tokens_per_mb=4096",
        "recover.mode=disabled",
        "saver.freq_epochs=null",
        "saver.freq_steps=null",
        "saver.freq_secs=null",
        "evaluator.freq_epochs=null",
        "stats_logger.wandb.mode=disabled",
    ]


def token_parity_reward_fn(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    """1.0 when the completion's token ids sum to an odd number: rewards that differ within
    a group even on a random model (whose GSM8K reward is 0 everywhere, which gives every
    group zero advantage and so a zero gradient), so the update is exercised for real."""
    return float(sum(int(t) for t in completion_ids) % 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_two_training_steps_on_tiny_model(name, tiny_lm_dir, tmp_path, monkeypatch):
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    monkeypatch.setenv("MODEL_PATH", tiny_lm_dir)
    cls = cli_args.PPOConfig if name == "gsm8k_ppo" else cli_args.GRPOConfig
    preset = str(ROOT / "examples/math" / f"{name}.yaml")
    loader_workers = 1 if name == PRESETS[0] else 0
    cfg, _ = cli_args.load_expr_config(
        ["--config", preset, *_cpu_overrides(tmp_path, loader_workers)], cls
    )
    if cfg.actor.overlong_reward_penalty:
        cfg.actor.overlong_tokens = min(cfg.actor.overlong_tokens, 8)
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        res = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=dict(
                reward_fn=token_parity_reward_fn,
                gconfig=cfg.gconfig,
                tokenizer=cfg.tokenizer_path,
            ),
        )
        rows = trainer.stats_logger.history
        assert trainer.rollout.get_version() == 2
    # close() stopped the dataloader's worker process (a leaked one is joined only when
    # garbage collection finds it, seconds per worker, during whatever test runs then)
    if loader_workers:
        workers = trainer.train_dataloader._iterator._workers
        assert workers and not any(w.is_alive() for w in workers)
    assert res["total_steps"] == 2
    assert [r["global_step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["update_successful"] == 1.0
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r["grad_norm"]
    if cfg.critic is not None:
        assert any(k.startswith("ppo_critic/") for k in rows[-1]), sorted(rows[-1])[:20]
        assert "critic/grad_norm" in rows[-1] and rows[-1]["critic/update_successful"] == 1.0
