"""Tests of the tiny tokenizer/model builder, the shipped base checkpoint and hf_utils."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal.dataset.synthetic import ArithSpec, generate_arith_problems
from areal.models import (
    EOS_TOKEN,
    PAD_TOKEN,
    build_tiny_tokenizer,
    get_tiny_base_path,
    tiny_model_config,
)
from areal.utils.hf_utils import load_hf_processor_and_tokenizer, load_hf_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    rows = generate_arith_problems(ArithSpec(n=500, seed=1), "tok")
    out = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(out, [r["question"] + "\n" + r["answer"] for r in rows])
    return out


def test_tiny_tokenizer_digits_single_tokens_and_roundtrip(tok_dir):
    tok = load_hf_tokenizer(str(tok_dir))
    assert len(tok) == 384
    for d in "0123456789":
        assert len(tok(d, add_special_tokens=False)["input_ids"]) == 1
    ids = tok("Mia has 1234 apples.", add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.isdigit()] == ["1", "2", "3", "4"]
    for text in ["7 + 5 = 12\n12 - 3 = 9\n#### 9", "Ünïcode ✓ and $1,000.50", "  two  spaces\t"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_tiny_tokenizer_chat_template_and_special_ids(tok_dir):
    tok = load_hf_tokenizer(str(tok_dir))
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 3)
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nWhat is 2+2?\nassistant\n"


def test_tiny_model_config_has_about_1m_params():
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_config(384)
    model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 1.0e6 < n < 1.1e6
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_shipped_tiny_base_loads_with_expected_architecture():
    from transformers import AutoModelForCausalLM

    path = Path(get_tiny_base_path())
    assert (path / "model.safetensors").stat().st_size < 10 * 2**20
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tok = load_hf_tokenizer(str(path))
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == (128, 4, 4, 2)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tok) == 384
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.eos_token_id == tok.eos_token_id
    # It answers in the trained format: greedy completion ends with a '#### N' line.
    prompt = tok.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Tom has 3 apples. He gets 4 more apples. Then he loses 2 apples. How many apples does Tom have now?",
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.startswith("3 + 4 = 7\n") and "\n#### " in text
    assert out[0, -1].item() == tok.eos_token_id


def test_load_hf_processor_and_tokenizer_text_model_has_no_processor(tok_dir):
    processor, tok = load_hf_processor_and_tokenizer(str(tok_dir))
    assert processor is None and tok.pad_token_id is not None
    with pytest.raises(ValueError, match="padding_side"):
        load_hf_tokenizer(str(tok_dir), padding_side="middle")
    assert load_hf_tokenizer(str(tok_dir), padding_side="left").padding_side == "left"
