"""``Qwen3ModelArgs``: the sizes of a qwen3 model, read from its HuggingFace config."""

from __future__ import annotations

from dataclasses import dataclass

from areal.models.archon.base import BaseModelArgs

__all__ = ["Qwen3ModelArgs"]


@dataclass
class Qwen3ModelArgs(BaseModelArgs):
    """Qwen3 sizes (``from_hf_config(hf_config)``: hidden_size, num_attention_heads, ...)."""
