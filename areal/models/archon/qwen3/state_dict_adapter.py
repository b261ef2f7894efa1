"""``Qwen3StateDictAdapter``: HuggingFace Qwen3ForCausalLM (or ForTokenClassification,
critic) names <-> the engine's names."""

from __future__ import annotations

from areal.models.archon.base import BaseStateDictAdapter

__all__ = ["Qwen3StateDictAdapter"]

_LAYER = "model.layers.{}."


class Qwen3StateDictAdapter(BaseStateDictAdapter):
    from_hf_map = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        _LAYER + "self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
        _LAYER + "self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
        _LAYER + "self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
        _LAYER + "self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
        _LAYER + "self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
        _LAYER + "self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
        _LAYER + "self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
        _LAYER + "self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
        _LAYER + "self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
        _LAYER + "self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
        _LAYER + "self_attn.rotary_emb.inv_freq": None,
        _LAYER + "mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
        _LAYER + "mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
        _LAYER + "mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
        _LAYER + "input_layernorm.weight": "layers.{}.attention_norm.weight",
        _LAYER + "post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
        "score.weight": "output.weight",
    }

    def to_hf_name(self, name: str) -> str:
        if name == "output.weight" and self.args.is_critic:
            return "score.weight"
        return super().to_hf_name(name)
