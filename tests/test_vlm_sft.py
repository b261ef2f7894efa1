"""SFT with images: SFTTrainer on the VLM loaders' ``type="sft"`` rows (pixel values in
``multi_modal_input``) through a real FSDP worker, on the shipped tiny VLM."""

from __future__ import annotations

import pytest

from areal.api.cli_args import SFTConfig, load_expr_config

SFT_YAML_LINES = """
experiment_name: vlm-sft-test
trial_name: t
seed: 1
total_train_epochs: 1
tokenizer_path: ${actor.path}
allocation_mode: fsdp:d1
cluster: {n_nodes: 1, n_gpus_per_node: 0}
actor:
  dtype: float32
  attn_impl: sdpa
  num_threads: 1
  mb_spec: {max_tokens_per_mb: 4096}
  optimizer: {type: adam, lr: 1.0e-3, weight_decay: 0.0, lr_scheduler_type: constant,
              warmup_steps_proportion: 0.0, gradient_clipping: 1.0}
train_dataset: {type: sft, batch_size: 16, shuffle: true}
saver: {freq_epochs: null, freq_steps: null}
recover: {mode: disabled}
stats_logger: {wandb: {mode: disabled}}
"""


@pytest.mark.slow
def test_sft_trainer_tiny_vlm_true_counts_lowers_loss_and_moves_vision_tower(tmp_path):
    import torch

    from areal import SFTTrainer
    from areal.dataset import get_custom_dataset
    from areal.models.tiny_vlm import get_tiny_vlm_path
    from areal.utils.hf_utils import load_hf_tokenizer
    from areal.utils.vlm import load_vlm_processor

    yaml_path = tmp_path / "sft.yaml"
    yaml_path.write_text(SFT_YAML_LINES)
    base = get_tiny_vlm_path()
    cfg, _ = load_expr_config(
        [
            "--config", str(yaml_path),
            f"actor.path={base}",
            f"cluster.fileroot={tmp_path}",
            "train_dataset.path=synthetic://clevr?n=160&seed=5&query=all&max_count=4",
            "total_train_steps=10",
        ],
        SFTConfig,
    )  # fmt: skip
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    processor = load_vlm_processor(cfg.tokenizer_path, tokenizer=tok)
    train = get_custom_dataset("train", cfg.train_dataset, tok, processor)
    assert "multi_modal_input" in train.column_names
    out = tmp_path / "after"
    with SFTTrainer(cfg, train_dataset=train) as trainer:
        result = trainer.train()
        trainer.save_hf(str(out))
    losses = result["losses"]
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses))), losses
    # the base counts from the image (loss ~0.3 nats/token); without the pixels it cannot
    # (measured ~1.5 when SFTTrainer dropped multi_modal_input)
    assert losses[0] < 0.6, losses
    # the base answers N+1 on 60% of its targets; SFT on the true counts lowers the loss
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    from transformers import Qwen2VLForConditionalGeneration

    before = dict(Qwen2VLForConditionalGeneration.from_pretrained(base).named_parameters())
    after = dict(Qwen2VLForConditionalGeneration.from_pretrained(str(out)).named_parameters())
    vision = [k for k in before if "visual" in k]
    assert vision and set(before) == set(after)
    # the images went through the vision tower: its weights received gradient
    assert any(not torch.equal(before[k], after[k]) for k in vision)
