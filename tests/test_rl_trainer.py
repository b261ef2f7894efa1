"""End-to-end PPOTrainer / SFTTrainer runs on the tiny model (real servers, real workers)."""

from __future__ import annotations

import json
import os

import pytest

from areal.api.cli_args import GRPOConfig, SFTConfig, load_expr_config

DEMO_YAML = os.path.join(os.path.dirname(__file__), "..", "examples", "math", "gsm8k_grpo_cpu.yaml")
SFT_YAML = os.path.join(os.path.dirname(__file__), "..", "examples", "math", "gsm8k_sft_cpu.yaml")


def _grpo_config(model_dir: str, fileroot: str, *extra: str) -> GRPOConfig:
    cfg, _ = load_expr_config(
        [
            "--config", DEMO_YAML,
            f"actor.path={model_dir}",
            f"cluster.fileroot={fileroot}",
            "train_dataset.path=synthetic://arith?n=256&seed=3",
            "train_dataset.batch_size=4",
            "gconfig.n_samples=4",
            "gconfig.max_new_tokens=12",
            "actor.dynamic_sampling=false",
            "recover.mode=disabled",
            *extra,
        ],
        GRPOConfig,
    )  # fmt: skip
    return cfg


def _rows(log_dir: str) -> list[dict]:
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _workflow_kwargs(cfg):
    return dict(
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=cfg.gconfig,
        tokenizer=cfg.tokenizer_path,
    )


@pytest.mark.slow
def test_ppo_trainer_async_two_workers_bounded_staleness_and_synced_weights(tiny_lm_dir, tmp_path):
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    eta = 1
    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=3",
        "allocation_mode=local:d1+fsdp:d2",
        f"rollout.max_head_offpolicyness={eta}",
    )
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    from areal.infra.rpc.traffic import RPC_TRAFFIC

    with PPOTrainer(cfg, train_dataset=train) as trainer:
        RPC_TRAFFIC.reset()
        result = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=_workflow_kwargs(cfg)
        )
        assert trainer.rollout.get_version() == 3
        assert trainer.actor.get_version() == 3
        # each actor worker received its shard of the batch once per step, and holds none now
        puts = {w: t.calls for (w, m), t in RPC_TRAFFIC.snapshot().items() if m == "store.put"}
        assert puts == {"actor/0": 3, "actor/1": 3}
        assert [h["n_batches"] for h in trainer.actor.stored_batches()] == [0, 0]
        log_dir = result["log_dir"]
    rows = _rows(log_dir)
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["batch/n_seqs"] == 16
        assert r["staleness/max"] <= eta
        if r["consistency/fresh_tokens"] > 0:
            # Server logprobs of tokens made with the current weights == trainer's recomputation.
            assert r["consistency/logp_absdiff_max"] < 1e-3, r
        assert r["update_successful"] == 1.0
    assert any(r["consistency/fresh_tokens"] > 0 for r in rows)
    assert os.path.exists(os.path.join(log_dir, "curves.png"))


@pytest.mark.slow
def test_sft_trainer_twenty_steps_lowers_loss(tiny_lm_dir, tmp_path):
    from areal import SFTTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg, _ = load_expr_config(
        [
            "--config",
            SFT_YAML,
            f"model.path={tiny_lm_dir}",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=20",
            # 20 steps x 32 rows: one epoch of 640 rows (the YAML's 20000 take seconds to
            # tokenise and only 640 are trained on).
            "train_dataset.path=synthetic://arith?digits=1&steps=2&n=640&seed=0",
        ],
        SFTConfig,
    )
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    with SFTTrainer(cfg, train_dataset=train) as trainer:
        result = trainer.train()
    losses = result["losses"]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_limit_cpu_controller_threads_cpu_run_one_thread_gpu_run_unchanged():
    import torch

    from areal.trainer.rl_trainer import limit_cpu_controller_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gpu = GRPOConfig()
        gpu.cluster.n_gpus_per_node = 8
        assert limit_cpu_controller_threads(gpu) is False
        assert torch.get_num_threads() == 2
        cpu = GRPOConfig()
        cpu.cluster.n_gpus_per_node = 0
        assert limit_cpu_controller_threads(cpu) is True
        assert torch.get_num_threads() == 1
        assert limit_cpu_controller_threads(cpu) is False  # already one thread
    finally:
        torch.set_num_threads(before)


class _RefuseOneVerify:
    """A weight-sync hook that refuses the weights of one sync at ``version`` (its verify
    raises, as the fingerprint check does when a server's weights differ), once."""

    def __init__(self, version: int):
        self.version = version
        self.refused: list[int] = []

    def verify(self, ctx) -> None:
        if ctx.version == self.version and not self.refused:
            self.refused.append(ctx.version)
            raise RuntimeError(f"weights of version {ctx.version} refused on purpose")


@pytest.mark.slow
@pytest.mark.timeout(600)  # the hang this guards against (36e058d) never ends by itself
def test_ppo_trainer_eta0_one_refused_sync_the_run_finishes_its_steps(tiny_lm_dir, tmp_path):
    """With ``max_head_offpolicyness=0`` a refused sync leaves the servers at the old
    version while the trainer consumed a batch: the staleness bound must count the
    refusal (``StalenessManager.on_sync_refused``) or the next batch never starts (CI hung
    10 min). Real trainer, worker and built-in server; the run must finish its steps."""
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.infra.weights.weight_sync import WeightSyncHook
    from areal.utils.hf_utils import load_hf_tokenizer

    steps = 4
    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        f"total_train_steps={steps}",
        "rollout.max_head_offpolicyness=0",
    )
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    hook = type("RefuseOneVerify", (_RefuseOneVerify, WeightSyncHook), {})(version=2)
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        trainer.weight_sync.add_hook(hook)
        result = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=_workflow_kwargs(cfg)
        )
        assert hook.refused == [2]
        # the servers serve what the trainer holds at the end
        assert trainer.rollout.get_version() == trainer.actor.get_version()
        log_dir = result["log_dir"]
    rows = _rows(log_dir)
    assert [r["global_step"] for r in rows] == list(range(steps))
    refused = [r["global_step"] for r in rows if r.get("weight_sync/consecutive_refusals", 0)]
    assert refused == [1]  # the sync after step 1 (to version 2); the others went through
    assert rows[1]["weight_sync/refusals_total"] == 1
    # the batch after the refusal was generated on the kept version 1 (the one-version
    # credit of the refusal); every other batch on the trainer's current weights (eta 0)
    assert [r["staleness/max"] for r in rows] == [0, 0, 1, 0]
    assert all(r["batch/n_seqs"] == 16 for r in rows)
