"""``Qwen3StateDictAdapter``: HuggingFace Qwen3ForCausalLM (or ForTokenClassification,
critic) names <-> the engine's names.

Qwen3's checkpoints use Qwen2's names plus the per-head ``q_norm``/``k_norm`` weights,
which the qwen2 map already lists (a Qwen2 checkpoint has none), so the map is qwen2's.
"""

from __future__ import annotations

from areal.models.archon.qwen2.state_dict_adapter import Qwen2StateDictAdapter

__all__ = ["Qwen3StateDictAdapter"]


class Qwen3StateDictAdapter(Qwen2StateDictAdapter):
    """The qwen2 name map (q/k norms included)."""
