"""``Qwen2ModelArgs``: the sizes of a qwen2 model, read from its HuggingFace config."""

from __future__ import annotations

from dataclasses import dataclass

from areal.models.archon.base import BaseModelArgs

__all__ = ["Qwen2ModelArgs"]


@dataclass
class Qwen2ModelArgs(BaseModelArgs):
    """Qwen2 sizes (``from_hf_config(hf_config)``: hidden_size, num_attention_heads, ...)."""
