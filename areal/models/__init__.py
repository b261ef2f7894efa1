"""Model adapters and the tiny default model (tokenizer builder, config, base checkpoint)."""

from areal.models.tiny import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    build_tiny_tokenizer,
    evaluate_accuracy,
    get_tiny_base_path,
    save_tokenizer,
    tiny_model_config,
)

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TINY_VOCAB_SIZE",
    "build_tiny_tokenizer",
    "evaluate_accuracy",
    "get_tiny_base_path",
    "save_tokenizer",
    "tiny_model_config",
]
