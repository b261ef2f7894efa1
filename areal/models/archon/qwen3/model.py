"""``Qwen3Model``: the qwen3 decoder in the engine's layout (see ``areal.models.archon.base``)."""

from __future__ import annotations

from areal.models.archon.base import DenseTransformer

__all__ = ["Qwen3Model"]


class Qwen3Model(DenseTransformer):
    """Qwen3: per-head RMSNorm of q and k before the rotary embedding; biases per attention_bias."""

    qkv_bias = False
    qk_norm = True
