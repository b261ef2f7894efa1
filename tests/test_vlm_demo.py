"""Two steps of the VLM demo (examples/vlm/clevr_count_grpo_cpu.yaml) on the shipped tiny
VLM: real server (image prefill), real FSDP worker, VisionRLVRWorkflow."""

from __future__ import annotations

import json
import math
import os

import pytest

from areal.api.cli_args import GRPOConfig, load_expr_config

ROOT = os.path.join(os.path.dirname(__file__), "..")
DEMO_YAML = os.path.join(ROOT, "examples", "vlm", "clevr_count_grpo_cpu.yaml")


@pytest.mark.slow
def test_vlm_demo_two_steps_finite_loss_versions_advance(tmp_path):
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.models.tiny_vlm import get_tiny_vlm_path
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg, _ = load_expr_config(
        [
            "--config", DEMO_YAML,
            f"actor.path={get_tiny_vlm_path()}",
            f"cluster.fileroot={tmp_path}",
            "train_dataset.path=synthetic://clevr?n=64&seed=3&query=all&max_count=4",
            "train_dataset.batch_size=4",
            "gconfig.n_samples=4",
            "gconfig.max_new_tokens=6",
            "actor.dynamic_sampling=false",
            "total_train_steps=2",
            "evaluator.freq_steps=null",
        ],
        GRPOConfig,
    )  # fmt: skip
    cfg.valid_dataset = None
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    kwargs = dict(
        reward_fn="areal.reward.clevr_count_70k.clevr_count_70k_reward_fn",
        gconfig=cfg.gconfig,
        tokenizer=cfg.tokenizer_path,
        processor=cfg.tokenizer_path,
    )
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        result = trainer.train(
            workflow="areal.workflow.vision_rlvr.VisionRLVRWorkflow", workflow_kwargs=kwargs
        )
        assert trainer.rollout.get_version() == 2
        assert trainer.actor.get_version() == 2
    with open(os.path.join(result["log_dir"], "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("global_step", -1) >= 0]
    assert [r["global_step"] for r in rows] == [0, 1]
    # step 0's rollouts were all sampled with the weights the trainer holds (version 0),
    # so the check below cannot pass vacuously
    assert rows[0]["consistency/fresh_tokens"] > 0, rows[0]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["batch/n_seqs"] == 16
        if r["consistency/fresh_tokens"] > 0:
            # the server's image-prompt logprobs == the trainer's recomputation
            assert r["consistency/logp_absdiff_max"] < 1e-3, r


def _demo_module():
    import importlib.util

    path = os.path.join(ROOT, "examples", "vlm", "clevr_count_grpo.py")
    spec = importlib.util.spec_from_file_location("clevr_count_grpo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shuffled_reward_control_permutes_values_across_batch_keeps_multiset():
    import torch

    demo = _demo_module()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0] * 4)
    seen = []

    def compute_advantages(batch):
        seen.append(batch["rewards"].clone())
        return batch

    wrapped = demo.ShuffledRewardAdvantages(compute_advantages, seed=1)
    batch = {"rewards": rewards.clone(), "input_ids": torch.arange(32)}
    out = wrapped(batch)
    # same values (the batch keeps its reward rate), another order, other keys untouched
    assert sorted(seen[0].tolist()) == sorted(rewards.tolist())
    assert not torch.equal(seen[0], rewards)
    assert torch.equal(out["input_ids"], torch.arange(32))
    assert torch.equal(batch["rewards"], rewards)  # the caller's batch is not modified
    # a new permutation every batch, reproducible from the seed
    wrapped({"rewards": rewards.clone()})
    assert not torch.equal(seen[0], seen[1])
    again = []
    demo.ShuffledRewardAdvantages(lambda b: again.append(b["rewards"]) or b, seed=1)(
        {"rewards": rewards.clone()}
    )
    assert torch.equal(again[0], seen[0])


@pytest.mark.slow
def test_answer_margins_shipped_base_prefers_off_by_one_in_every_class():
    import importlib.util

    path = os.path.join(ROOT, "examples", "vlm", "answer_margins.py")
    spec = importlib.util.spec_from_file_location("answer_margins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--n", "32"])
    assert sorted(result) == ["1", "2", "3", "4"]
    for cls in result.values():
        # the demo's premise: greedy answers N+1, by a margin RL has to cross
        assert cls["greedy_correct"] == 0 and cls["min_margin"] > 0.2, result
