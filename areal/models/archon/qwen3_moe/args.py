"""``Qwen3MoeModelArgs``: the sizes of a qwen3_moe model, read from its HuggingFace
``Qwen3MoeConfig`` (the dense sizes plus the experts')."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal.models.archon.base import BaseModelArgs

__all__ = ["Qwen3MoeModelArgs"]


@dataclass
class Qwen3MoeModelArgs(BaseModelArgs):
    """``n_experts``, ``top_k`` (num_experts_per_tok), ``moe_hidden_dim``
    (moe_intermediate_size), ``norm_topk_prob``, ``decoder_sparse_step``,
    ``mlp_only_layers`` (dense layers), ``router_aux_loss_coef``."""

    top_k: int = 1
    moe_hidden_dim: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0

    @classmethod
    def from_hf_config(cls, hf: Any, *, is_critic: bool = False) -> Qwen3MoeModelArgs:
        base = BaseModelArgs.from_hf_config(hf, is_critic=is_critic)
        return cls(
            **vars(base),
            top_k=int(hf.num_experts_per_tok),
            moe_hidden_dim=int(hf.moe_intermediate_size),
            norm_topk_prob=bool(hf.norm_topk_prob),
            decoder_sparse_step=int(hf.decoder_sparse_step),
            mlp_only_layers=list(hf.mlp_only_layers or []),
            router_aux_loss_coef=float(hf.router_aux_loss_coef),
        )

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule: an MoE layer unless listed in mlp_only_layers."""
        return (
            layer not in self.mlp_only_layers
            and self.n_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )
