"""Hugging Face helpers: tokenizer / processor loading (local paths only at run time)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from areal.utils import logging

logger = logging.getLogger("HFUtils")


@lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str, fast_tokenizer: bool, padding_side: str | None):
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"use_fast": fast_tokenizer, "trust_remote_code": False}
    if padding_side is not None:
        kwargs["padding_side"] = padding_side
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if tok.pad_token_id is None:
        if tok.eos_token is not None:
            tok.pad_token = tok.eos_token
            logger.info("Tokenizer at %s has no pad token; using EOS %r", path, tok.eos_token)
        else:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
            logger.warning("Tokenizer at %s has neither pad nor EOS token; added '<|pad|>'", path)
    return tok


def load_hf_tokenizer(
    model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None
):
    """``AutoTokenizer.from_pretrained`` with a pad token guaranteed (EOS if missing).

    Cached per (path, fast_tokenizer, padding_side): callers get the same object, so do
    not mutate it. ``padding_side`` is ``"left"``/``"right"``/``None`` (tokenizer default).
    """
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side={padding_side!r}; allowed: None, 'left', 'right'")
    return _load_tokenizer_cached(str(model_name_or_path), bool(fast_tokenizer), padding_side)


def load_hf_processor_and_tokenizer(
    model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None
):
    """(processor or None, tokenizer). Text-only models have no processor."""
    tokenizer = load_hf_tokenizer(model_name_or_path, fast_tokenizer, padding_side)
    processor = None
    try:
        from transformers import AutoProcessor

        candidate = AutoProcessor.from_pretrained(str(model_name_or_path))
        # For text-only models AutoProcessor falls back to the tokenizer itself.
        if not hasattr(candidate, "pad_token_id") or hasattr(candidate, "image_processor"):
            processor = candidate
    except Exception as e:  # no processor config: a text-only model
        logger.debug("No processor for %s: %s", model_name_or_path, e)
    return processor, tokenizer
