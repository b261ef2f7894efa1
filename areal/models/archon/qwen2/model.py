"""``Qwen2Model``: the qwen2 decoder in the engine's layout (see ``areal.models.archon.base``)."""

from __future__ import annotations

from areal.models.archon.base import DenseTransformer

__all__ = ["Qwen2Model"]


class Qwen2Model(DenseTransformer):
    """Qwen2: q/k/v projections with bias, no q/k norms."""

    qkv_bias = True
    qk_norm = False
