"""PPOTrainer with AReaL's trainer semantics (real servers, real workers, tiny model).

The workflow below is written the way an AReaL user writes one (AReaL's custom-workflow
tutorial shape): it generates ONE trajectory per ``arun_episode`` call and returns AReaL's
dtypes (int32 ids, a 0-d reward tensor unsqueezed to ``[1]``). The trainer must form the
groups (``gconfig.n_samples`` runs per prompt), apply ``dynamic_filter_fn`` per group and
normalise advantages per group.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.api.io_struct import ModelRequest
from areal.api.workflow_api import RolloutWorkflow

DEMO_YAML = os.path.join(os.path.dirname(__file__), "..", "examples", "math", "gsm8k_grpo_cpu.yaml")
N, BS = 4, 3


class ParityWorkflow(RolloutWorkflow):
    """One sample per call; reward 1 when the completion has an even number of tokens."""

    def __init__(self, gconfig, tokenizer):
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.calls = 0

    async def arun_episode(self, engine, data):
        self.calls += 1
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"], tokenize=True, add_generation_prompt=True
        )
        if hasattr(input_ids, "keys"):
            input_ids = input_ids["input_ids"]
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(input_ids),
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)
        reward = float(resp.output_len % 2 == 0)
        seq = resp.input_tokens + resp.output_tokens
        res = {
            "input_ids": torch.tensor(seq, dtype=torch.int32),
            "loss_mask": torch.tensor(
                [0] * resp.input_len + [1] * resp.output_len, dtype=torch.int32
            ),
            "logprobs": torch.tensor([0.0] * resp.input_len + resp.output_logprobs),
            "versions": torch.tensor(
                [-1] * resp.input_len + resp.output_versions, dtype=torch.int32
            ),
            "attention_mask": torch.ones(len(seq), dtype=torch.bool),
            "rewards": torch.tensor(reward, dtype=torch.float32),
        }
        return {k: v.unsqueeze(0) for k, v in res.items()}


def not_all_equal(group: dict) -> bool:
    r = group["rewards"]
    return bool((r != r[0]).any())


class CountingFilter:
    """``not_all_equal`` that also rejects the first group it sees (so that every run takes
    the rejection path) and counts its verdicts."""

    def __init__(self):
        self.accepted = self.rejected = 0

    def __call__(self, group: dict) -> bool:
        ok = (self.accepted + self.rejected) > 0 and not_all_equal(group)
        if ok:
            self.accepted += 1
        else:
            self.rejected += 1
        return ok


def _config(model_dir: str, fileroot: str, *extra: str) -> GRPOConfig:
    cfg, _ = load_expr_config(
        [
            "--config", DEMO_YAML,
            f"actor.path={model_dir}",
            f"cluster.fileroot={fileroot}",
            "train_dataset.path=synthetic://arith?n=64&seed=5",
            "valid_dataset.path=synthetic://arith?n=3&seed=6",
            f"train_dataset.batch_size={BS}",
            f"gconfig.n_samples={N}",
            "gconfig.max_new_tokens=6",
            "eval_gconfig.n_samples=2",
            "eval_gconfig.max_new_tokens=4",
            "actor.dynamic_sampling=false",
            # the filters below must see every trained group: no per-step bound (most
            # groups of the random model are all-equal; tests/test_generation_bound.py)
            "rollout.max_num_gen_batches=null",
            "actor.ppo_n_minibatches=1",
            "recover.mode=disabled",
            "evaluator.freq_steps=null",
            "total_train_steps=2",
            *extra,
        ],
        GRPOConfig,
    )  # fmt: skip
    return cfg


def _group_rows(batch: dict) -> list[list[int]]:
    prompt = batch["attention_mask"].bool() & ~batch["loss_mask"].bool()
    keys = [tuple(batch["input_ids"][i][prompt[i]].tolist()) for i in range(len(prompt))]
    return [keys[g * N : (g + 1) * N] for g in range(len(keys) // N)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_areal_style_workflow_trains_in_whole_groups_with_filter(tiny_lm_dir, tmp_path):
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _config(tiny_lm_dir, str(tmp_path))
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    valid = get_custom_dataset("test", cfg.valid_dataset, tok)
    wf = ParityWorkflow(cfg.gconfig, tok)
    seen: list[dict] = []
    flt = CountingFilter()
    with PPOTrainer(cfg, train_dataset=train, valid_dataset=valid) as trainer:
        inner = trainer.actor.compute_advantages

        def spy(batch):
            out = inner(batch)
            seen.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
            return out

        trainer.actor.compute_advantages = spy
        result = trainer.train(
            wf,
            ParityWorkflow(cfg.eval_gconfig, tok),
            dynamic_filter_fn=flt,
        )
        rejected = trainer.rollout.workflow_executor.rejection_reasons.get("filtered", 0)

    assert len(seen) == 2
    for batch in seen:
        # exactly batch_size groups of n_samples rows (not n^2), each from one prompt
        assert batch["input_ids"].shape[0] == BS * N
        groups = _group_rows(batch)
        assert all(len(set(g)) == 1 for g in groups)
        rewards = batch["rewards"].float().view(BS, N)
        # the filter saw whole groups: no trained group has all-equal rewards
        assert all(bool((r != r[0]).any()) for r in rewards)
        # GRPO: advantages normalised per group of n (reward_norm group/group, no adv_norm)
        lm = batch["loss_mask"].bool()
        first = lm.float().argmax(-1)
        adv = batch["advantages"][torch.arange(BS * N), first].view(BS, N)
        expect = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(adv, expect, atol=1e-3, rtol=1e-3)
    # every call produced one trajectory; the trainer ran n per prompt
    assert wf.calls % N == 0 and wf.calls >= 2 * BS * N
    # every group the filter rejected is counted as "filtered" (and none was trained on:
    # the reward check above); the accepted ones filled both steps
    assert rejected == flt.rejected >= 1
    assert flt.accepted >= 2 * BS
    # evaluation: eval_gconfig.n_samples runs per validation prompt; the demo YAML sets
    # evaluator.eval_before_train, so the base model is evaluated first
    assert result["final_eval"]["eval/n"] == 3 * 2
    assert result["initial_eval"]["eval/n"] == 3 * 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sync_training_dynamic_bs_trains_fewer_whole_groups(tiny_lm_dir, tmp_path):
    """async_training=false + dynamic_bs: rejected groups shrink the batch, never split it."""
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _config(
        tiny_lm_dir,
        str(tmp_path),
        "async_training=false",
        "dynamic_bs=true",
        "evaluator.eval_before_train=false",
    )
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    valid = get_custom_dataset("test", cfg.valid_dataset, tok)
    seen: list[dict] = []
    with PPOTrainer(cfg, train_dataset=train, valid_dataset=valid) as trainer:
        inner = trainer.actor.compute_advantages

        def spy(batch):
            out = inner(batch)
            seen.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
            return out

        trainer.actor.compute_advantages = spy
        result = trainer.train(
            ParityWorkflow(cfg.gconfig, tok),
            ParityWorkflow(cfg.eval_gconfig, tok),
            dynamic_filter_fn=not_all_equal,
        )
    assert len(seen) == 2
    # evaluator.eval_before_train=false: no evaluation of the base model, one at the end
    assert "initial_eval" not in result and result["final_eval"]["eval/n"] == 3 * 2
    for batch in seen:
        rows = batch["input_ids"].shape[0]
        assert 0 < rows <= BS * N and rows % N == 0
        groups = _group_rows(batch)
        assert all(len(set(g)) == 1 for g in groups)
        for r in batch["rewards"].float().view(-1, N):
            assert bool((r != r[0]).any())
