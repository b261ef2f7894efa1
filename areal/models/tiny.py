"""The tiny default model: byte-level BPE tokenizer, ChatML template, Qwen2 config.

Sized for learning on one CPU thread (see NOTES "Learning on CPU"): 384-token byte-level
BPE in which every digit is its own token, and a Qwen2 decoder with hidden 128, 4 layers,
4 attention heads, 2 KV heads, tied embeddings (~1.03M parameters).

- :func:`build_tiny_tokenizer` trains the tokenizer on a text corpus and saves it (with the
  chat template) so that ``AutoTokenizer.from_pretrained(dir)`` works.
- :func:`tiny_model_config` returns the ``Qwen2Config``.
- :func:`get_tiny_base_path` is the shipped SFT base checkpoint
  (``areal/models/assets/tiny-base``; rebuilt by ``examples/math/build_tiny_base.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from areal.utils import logging

logger = logging.getLogger("TinyModel")

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", PAD_TOKEN]
TINY_VOCAB_SIZE = 384

# ChatML, as in Qwen2: <|im_start|>{role}\n{content}<|im_end|>\n ...
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ASSETS = Path(__file__).resolve().parent / "assets"


def get_tiny_base_path() -> str:
    """Directory of the shipped tiny base checkpoint (config, safetensors, tokenizer)."""
    path = _ASSETS / "tiny-base"
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"tiny base checkpoint missing at {path}; rebuild it with "
            "`python examples/math/build_tiny_base.py`"
        )
    return str(path)


def build_tiny_tokenizer(
    out_dir: str | os.PathLike | None,
    corpus: Iterable[str],
    vocab_size: int = TINY_VOCAB_SIZE,
    model_max_length: int = 1024,
):
    """Train the byte-level BPE on ``corpus`` and return a ``PreTrainedTokenizerFast``.

    Digits are split one per pre-token, so every digit is a single token and no merge
    spans digits. Special tokens: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (EOS),
    ``<|pad|>`` (pad). When ``out_dir`` is given, the tokenizer is saved there with the
    chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    n_base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_base:
        raise ValueError(f"vocab_size={vocab_size}; must be >= {n_base} (bytes + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        logger.warning(
            "Tokenizer has %d tokens (asked %d): the corpus ran out of merges",
            tok.get_vocab_size(),
            vocab_size,
        )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        save_tokenizer(hf_tok, out_dir)
    return hf_tok


def save_tokenizer(tokenizer, out_dir: str | os.PathLike) -> None:
    """``save_pretrained`` that also writes the chat template into tokenizer_config.json."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") != tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def tiny_model_config(vocab_size: int = TINY_VOCAB_SIZE, **overrides):
    """``Qwen2Config`` of the tiny model (~1.03M parameters at vocab 384).

    hidden 128, intermediate 512, 4 layers, 4 heads, 2 KV heads, tied embeddings,
    1024 positions. ``overrides`` replace any field. Token ids follow the tokenizer built
    by :func:`build_tiny_tokenizer` (specials first: endoftext 0, im_start 1, im_end 2,
    pad 3).
    """
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        use_cache=True,
        torch_dtype="float32",
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def evaluate_accuracy(
    model,
    tokenizer,
    problems: list[dict],
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    batch_size: int = 128,
    seed: int = 0,
) -> dict:
    """Accuracy of ``model`` on GSM8K-format ``problems`` (rows with ``question``, ``answer``).

    Prompts are the chat template of one user message (the question), as the RL datasets
    build them; completions are scored with ``gsm8k_reward_fn`` against each row's
    ``answer``. Returns ``{"accuracy", "n", "completions"}``. Plain HF ``generate`` with
    left padding; meant for the tiny model on CPU, not for large-scale evaluation.
    """
    import torch

    from areal.reward.gsm8k import gsm8k_reward_fn

    was_training = model.training
    model.eval()
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    completions: list[str] = []
    correct = 0
    try:
        for start in range(0, len(problems), batch_size):
            rows = problems[start : start + batch_size]
            prompts = [
                _chat_prompt_ids(tokenizer, [{"role": "user", "content": r["question"]}])
                for r in rows
            ]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                input_ids[i, width - len(p) :] = torch.tensor(p)
                attn[i, width - len(p) :] = 1
            # Seeded sampling that leaves the caller's global RNG state untouched.
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed + start)
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attn,
                    max_new_tokens=max_new_tokens,
                    do_sample=not greedy,
                    temperature=temperature if not greedy else None,
                    top_p=None,
                    top_k=None,
                    eos_token_id=eos_id,
                    pad_token_id=pad_id,
                )
            for r, seq in zip(rows, out[:, width:].tolist(), strict=True):
                text = tokenizer.decode(seq, skip_special_tokens=True)
                completions.append(text)
                correct += gsm8k_reward_fn(r["question"], text, [], seq, r["answer"]) == 1.0
    finally:
        model.train(was_training)
    n = len(problems)
    return {"accuracy": correct / n if n else 0.0, "n": n, "completions": completions}


def _chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return list(out)
