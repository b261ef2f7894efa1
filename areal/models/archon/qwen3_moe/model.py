"""``Qwen3MoeModel``: the qwen3 decoder with MoE feed-forwards (see ``areal.models.archon.moe``).

``forward(tokens, positions, cu_seqlens, routed_experts=None)``: ``routed_experts``
``[tokens, n_moe_layers, top_k]`` replays that routing (one slice per MoE layer, in layer
order); ``routed_experts()`` after a forward returns the experts each token went to, in
the same shape; ``router_logits()`` the MoE layers' router logits (for the aux loss).
"""

from __future__ import annotations

import torch
from torch import nn

from areal.models.archon.base import DenseTransformer
from areal.models.archon.moe import MoE, MoEDecoderBlock, load_balancing_loss

__all__ = ["Qwen3MoeModel"]


class Qwen3MoeModel(DenseTransformer):
    """Qwen3 attention (q/k norms), MoE or dense SwiGLU per layer (``args.is_sparse``)."""

    qkv_bias = False
    qk_norm = True

    def __init__(self, args):
        super().__init__(args)
        o_bias = args.attention_bias
        self.layers = nn.ModuleDict(
            {
                str(i): MoEDecoderBlock(
                    args,
                    sparse=args.is_sparse(i),
                    qkv_bias=args.attention_bias,
                    qk_norm=True,
                    o_bias=o_bias,
                )
                for i in range(args.n_layers)
            }
        )

    def moe_modules(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, tokens, positions, cu_seqlens, routed_experts: torch.Tensor | None = None):
        moes = self.moe_modules()
        for j, m in enumerate(moes):
            m.replay = None if routed_experts is None else routed_experts[:, j]
        try:
            return super().forward(tokens, positions, cu_seqlens)
        finally:
            for m in moes:
                m.replay = None

    def routed_experts(self) -> torch.Tensor:
        """``[tokens, n_moe_layers, top_k]`` expert ids of the last forward."""
        return torch.stack([m.last_indices for m in self.moe_modules()], dim=1)

    def router_logits(self) -> list[torch.Tensor]:
        return [m.last_logits for m in self.moe_modules()]

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward (unscaled; times
        ``args.router_aux_loss_coef`` when added to a training loss)."""
        return load_balancing_loss(self.router_logits(), self.args.n_experts, self.args.top_k)
