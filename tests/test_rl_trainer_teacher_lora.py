"""PPOTrainer with a distillation teacher and with LoRA: short real runs (servers, workers).

- Teacher (``examples/distillation/gsm8k_grpo_distill_cpu.yaml``, pure distillation): the
  batch handed to the actor's update carries ``teacher_logp`` equal to the shipped
  teacher's own log-probabilities (recomputed here with transformers), and the loss's
  ``rkl_loss`` statistic is the mean of ``logp - teacher_logp`` over the loss tokens.
- LoRA (``actor.use_lora``, disk sync): every weight push is an adapter only (PEFT files,
  LoRA tensors, trained ``lora_B``), and after the first push the server samples with
  the adapter: the trainer's recomputed log-probabilities of those tokens equal the
  server's.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from areal.api.cli_args import GRPOConfig, load_expr_config

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DISTILL_YAML = os.path.join(ROOT, "examples", "distillation", "gsm8k_grpo_distill_cpu.yaml")
DEMO_YAML = os.path.join(ROOT, "examples", "math", "gsm8k_grpo_cpu.yaml")
BS, N = 2, 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _config(yaml: str, fileroot: str, *extra: str) -> GRPOConfig:
    cfg, _ = load_expr_config(
        [
            "--config", yaml,
            f"cluster.fileroot={fileroot}",
            "train_dataset.path=synthetic://arith?digits=1&steps=2&n=32&seed=5",
            f"train_dataset.batch_size={BS}",
            f"gconfig.n_samples={N}",
            "gconfig.max_new_tokens=8",
            "actor.ppo_n_minibatches=1",
            "rollout.max_head_offpolicyness=0",
            "recover.mode=disabled",
            "evaluator.freq_steps=null",
            "saver.freq_steps=null",
            *extra,
        ],
        GRPOConfig,
    )  # fmt: skip
    cfg.valid_dataset = None
    return cfg


def _stats(log_dir: str) -> list[dict]:
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("global_step", -1) >= 0]


def _train(cfg, spy_update=None):
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        if spy_update is not None:
            inner = trainer.actor.ppo_update

            def spy(batch):
                spy_update.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
                return inner(batch)

            trainer.actor.ppo_update = spy
        result = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=dict(
                reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
                gconfig=cfg.gconfig,
                tokenizer=cfg.tokenizer_path,
            ),
        )
    return _stats(result["log_dir"])


@torch.no_grad()
def _hf_logp(model_dir: str, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logp[b, i]`` of ``input_ids[b, i]`` under ``model_dir`` (0 at position 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logits = model(input_ids).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(input_ids.shape[0], 1), lp], dim=1)


def test_ppo_trainer_with_teacher_feeds_teacher_logprobs_into_the_loss(tmp_path):
    torch.set_num_threads(1)
    cfg = _config(DISTILL_YAML, str(tmp_path), "total_train_steps=1")
    assert cfg.teacher is not None and cfg.teacher.rl_loss_weight == 0.0
    seen: list[dict] = []
    rows = _train(cfg, spy_update=seen)
    assert len(seen) == 1 and len(rows) == 1
    batch = seen[0]
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    assert mask.any()
    # the teacher's log-probabilities, not the student's: recompute both with transformers
    # (right-padded rows: the padding never precedes a loss token, so causal logits hold)
    ids = batch["input_ids"].long() * batch["attention_mask"].long()
    teacher_dir = os.path.join(ROOT, cfg.teacher.path)
    teacher = _hf_logp(teacher_dir, ids, cfg.teacher.temperature)
    student = _hf_logp(os.path.join(ROOT, cfg.actor.path), ids, cfg.actor.temperature)
    torch.testing.assert_close(batch["teacher_logp"][mask], teacher[mask], atol=2e-4, rtol=0)
    assert (teacher[mask] - student[mask]).abs().max() > 1e-2  # the two models differ
    assert torch.all(batch["rl_loss_weight"] == 0.0)
    assert torch.all(batch["distill_loss_weight"] == cfg.teacher.distill_loss_weight)
    # the loss used them: one minibatch, on-policy (logp == prox_logp), so the reverse-KL
    # term per token is logp - teacher_logp
    (key,) = [k for k in rows[0] if k.endswith("rkl_loss/avg")]
    want = float((batch["prox_logp"][mask] - teacher[mask]).mean())
    assert rows[0][key] == pytest.approx(want, abs=5e-4), (rows[0][key], want)
    assert abs(want) > 2e-3  # far from the 0 a teacher equal to the student would give


def test_ppo_trainer_with_lora_pushes_only_adapters_and_servers_sample_with_them(tmp_path):
    from safetensors.torch import load_file

    cfg = _config(
        DEMO_YAML,
        str(tmp_path),
        "total_train_steps=2",
        "actor.use_lora=true",
        "actor.lora_rank=8",
        "actor.lora_alpha=16",
        # small: Adam's first step moves every adapter weight by ~lr, and at 0.02 one
        # seeded run's model answered every group of step 1 alike, so the demo's
        # dynamic-sampling filter (8-token answers: ~97% of groups without signal even
        # before) waited for a group with signal until the test timed out
        "actor.optimizer.lr=0.002",
        "actor.weight_update_mode=disk",
        # lora_B moves only on a group with signal: the filter waits for one, with no
        # per-step bound (at the bound a step may train on all-equal groups: no gradient)
        "rollout.max_num_gen_batches=null",
    )
    rows = _train(cfg)
    assert [r["global_step"] for r in rows] == [0, 1]
    # every push is an adapter: PEFT files only, LoRA tensors only, lora_B trained (PEFT
    # initialises it to zero)
    adapters = sorted(
        glob.glob(os.path.join(str(tmp_path), "**", "adapter_model.safetensors"), recursive=True)
    )
    assert adapters, sorted(
        glob.glob(os.path.join(str(tmp_path), "**", "*.safetensors"), recursive=True)
    )
    for path in adapters:
        assert sorted(os.listdir(os.path.dirname(path))) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        tensors = load_file(path)
        assert tensors and all("lora_A" in k or "lora_B" in k for k in tensors), list(tensors)
        assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)
    assert not glob.glob(os.path.join(str(tmp_path), "**", "model.safetensors"), recursive=True)
    # step 1 trained on tokens sampled after the first push (max_head_offpolicyness 0):
    # the server's logprobs are the trainer's, i.e. the server applied the adapter
    assert rows[1]["consistency/fresh_tokens"] > 0, rows[1]
    assert rows[1]["consistency/logp_absdiff_max"] < 1e-3, rows[1]
