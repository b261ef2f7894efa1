"""The tiny vision-language model: a Qwen2-VL architecture small enough for one CPU thread.

- Tokenizer: the tiny text tokenizer (:mod:`areal.models.tiny`, 384 tokens) plus Qwen2-VL's
  four vision tokens (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>``, ids 384-387) and a ChatML template whose message ``content`` may be a
  list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts.
- Image processor: ``Qwen2VLImageProcessor`` settings with patch 14, merge 2, and
  ``max_pixels = 84 * 84``: an 84x84 image is 6x6 patches, 9 image tokens.
- Model: ``Qwen2VLForConditionalGeneration`` with a 2-block vision tower (embed 64, 4 heads)
  projecting into a Qwen2 decoder of hidden 128, 4 layers, 4 heads, 2 KV heads, M-RoPE
  sections (4, 6, 6), tied embeddings.

:func:`get_tiny_vlm_path` is the shipped base checkpoint
(``areal/models/assets/tiny-vlm``, rebuilt by ``examples/vlm/build_tiny_vlm.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal.utils.vlm import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, QwenVLProcessor

VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
IMAGE_SIZE = 84

# ChatML with list contents: images become <|vision_start|><|image_pad|><|vision_end|>.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ASSETS = Path(__file__).resolve().parent / "assets"


def get_tiny_vlm_path() -> str:
    """Directory of the shipped tiny VLM (config, safetensors, tokenizer, image processor)."""
    path = _ASSETS / "tiny-vlm"
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"tiny VLM missing at {path}; rebuild it with `python examples/vlm/build_tiny_vlm.py`"
        )
    return str(path)


def build_tiny_vlm_tokenizer(text_tokenizer_dir: str | None = None):
    """The tiny text tokenizer with the four vision tokens and the VLM chat template."""
    from transformers import AutoTokenizer

    from areal.models.tiny import get_tiny_base_path

    tok = AutoTokenizer.from_pretrained(text_tokenizer_dir or get_tiny_base_path())
    extra = ["<|endoftext|>", "<|im_start|>", *VISION_TOKENS]
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def tiny_vlm_image_processor(image_size: int = IMAGE_SIZE):
    """``Qwen2VLImageProcessor`` (PIL backend) that keeps ``image_size`` squares as they are."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        min_pixels=28 * 28,
        max_pixels=image_size * image_size,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def build_tiny_vlm_processor(image_size: int = IMAGE_SIZE) -> QwenVLProcessor:
    return QwenVLProcessor(tiny_vlm_image_processor(image_size), build_tiny_vlm_tokenizer())


def tiny_vlm_config(tokenizer: Any, **text_overrides: Any):
    """``Qwen2VLConfig`` of the tiny VLM for ``tokenizer`` (ids of the vision tokens)."""
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    text.update(text_overrides)
    vision = dict(
        depth=2,
        embed_dim=64,
        num_heads=4,
        mlp_ratio=2,
        hidden_size=text["hidden_size"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tiny_vlm(model: Any, processor: QwenVLProcessor, out_dir: str | os.PathLike) -> None:
    """Model (safetensors), tokenizer with template, and ``preprocessor_config.json``."""
    from areal.models.tiny import save_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    save_tokenizer(processor.tokenizer, out)
    ip = processor.image_processor
    cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "min_pixels": ip.size["shortest_edge"],
        "max_pixels": ip.size["longest_edge"],
        "size": dict(ip.size),
        "patch_size": ip.patch_size,
        "temporal_patch_size": ip.temporal_patch_size,
        "merge_size": ip.merge_size,
        "image_mean": list(ip.image_mean),
        "image_std": list(ip.image_std),
    }
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def vlm_prompt_messages(problem: str) -> list[dict]:
    """One user turn: the image(s) of ``problem`` (``<image>`` placeholders) then its text."""
    n_images = max(1, problem.count("<image>"))
    text = problem.replace("<image>", "").strip()
    return [
        {
            "role": "user",
            "content": [{"type": "image"} for _ in range(n_images)]
            + [{"type": "text", "text": text}],
        }
    ]


def collate_vlm_prompts(processor: Any, rows: list[dict], suffix: str = "", left_pad: bool = True):
    """Left-padded generation batch (``input_ids``, ``attention_mask``, ``mm_token_type_ids``,
    ``pixel_values``, ``image_grid_thw``) of rows with ``problem`` and ``images``."""
    import torch

    texts, images = [], []
    for r in rows:
        msgs = vlm_prompt_messages(r["problem"] + suffix)
        texts.append(
            processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        )
        images.extend(r["images"])
    enc = processor(text=texts, images=images, return_tensors=None)
    ids = enc["input_ids"]
    width = max(len(x) for x in ids)
    pad = processor.tokenizer.pad_token_id
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    attn = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        sl = slice(width - len(x), width) if left_pad else slice(0, len(x))
        input_ids[i, sl] = torch.tensor(x)
        attn[i, sl] = 1
    mm = ((input_ids == processor.image_token_id) & attn.bool()).to(torch.int32)
    return dict(
        input_ids=input_ids,
        attention_mask=attn,
        mm_token_type_ids=mm,
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
    )


def evaluate_vlm_accuracy(
    model: Any,
    processor: Any,
    rows: list[dict],
    *,
    suffix: str = "",
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    seed: int = 0,
) -> dict:
    """Accuracy of ``model`` on counting rows (``problem``, ``answer``, ``images``), scored by
    ``clevr_count_70k_reward_fn`` against each row's true ``answer``. Also reports
    ``off_by_one`` (answer = true + 1, the tiny VLM's trained bias). HF ``generate``."""
    import torch

    from areal.reward.clevr_count_70k import clevr_count_70k_reward_fn, extract_answer

    was_training = model.training
    model.eval()
    tok = processor.tokenizer
    correct = off = 0
    completions: list[str] = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            batch = collate_vlm_prompts(processor, chunk, suffix)
            width = batch["input_ids"].shape[1]
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed + start)
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=not greedy,
                    temperature=temperature if not greedy else None,
                    top_p=None,
                    top_k=None,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            for r, seq in zip(chunk, out[:, width:].tolist(), strict=True):
                text = tok.decode(seq, skip_special_tokens=True)
                completions.append(text)
                correct += clevr_count_70k_reward_fn("", text, [], seq, r["answer"]) == 1.0
                pred = extract_answer(text)
                off += pred.strip() == str(int(r["answer"]) + 1)
    finally:
        model.train(was_training)
    n = len(rows)
    return {
        "accuracy": correct / n if n else 0.0,
        "off_by_one": off / n if n else 0.0,
        "n": n,
        "completions": completions,
    }


def build_random_tiny_vlm(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Save a randomly initialised tiny VLM (for tests); returns the directory."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    processor = build_tiny_vlm_processor()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(tiny_vlm_config(processor.tokenizer))
    save_tiny_vlm(model, processor, out_dir)
    return str(out_dir)
