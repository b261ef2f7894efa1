"""What every archon model family provides: model arguments read from a HuggingFace
config (``BaseModelArgs``), a dense decoder built from them (``DenseTransformer``) and a
state-dict adapter between the HuggingFace names and the engine's (``BaseStateDictAdapter``).

The engine's layout (torchtitan's names): ``tok_embeddings``, ``layers.<i>.attention.
{wq,wk,wv,wo,q_norm,k_norm}``, ``layers.<i>.{attention_norm,ffn_norm}``,
``layers.<i>.feed_forward.{w1,w2,w3}``, ``norm``, ``output`` (the LM head, or a 1-wide
value head for critics). The layers sit in a ``ModuleDict`` keyed by index so a pipeline
split can keep their names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from areal.models.archon.layers import DecoderBlock, RMSNorm, rope_cos_sin

__all__ = ["BaseModelArgs", "BaseStateDictAdapter", "DenseTransformer"]


@dataclass
class BaseModelArgs:
    """Sizes of a dense decoder (HuggingFace config -> ``from_hf_config``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    n_experts: int = 0  # 0: dense
    is_critic: bool = False

    @classmethod
    def from_hf_config(cls, hf: Any, *, is_critic: bool = False) -> BaseModelArgs:
        rope = getattr(hf, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_parameters.rope_type={rope.get('rope_type')!r}: only 'default' rotary "
                "embeddings are supported by the archon models"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            dim=hf.hidden_size,
            n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads,
            n_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            hidden_dim=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            n_experts=int(getattr(hf, "num_experts", 0) or 0),
            is_critic=is_critic,
        )


class DenseTransformer(nn.Module):
    """Embedding, decoder blocks, final norm, output head; packed tokens in, logits out.

    ``forward(tokens [n], positions [n], cu_seqlens [s+1]) -> [n, vocab]`` (``[n, 1]``
    values for a critic). Subclasses fix the block's flags (``qkv_bias``, ``qk_norm``)."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, args: BaseModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        o_bias = args.attention_bias and self.qk_norm  # qwen3: o_proj follows attention_bias
        qkv_bias = self.qkv_bias or args.attention_bias
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderBlock(args, qkv_bias=qkv_bias, qk_norm=self.qk_norm, o_bias=o_bias)
                for i in range(args.n_layers)
            }
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        out = 1 if args.is_critic else args.vocab_size
        self.output = nn.Linear(args.dim, out, bias=False)
        if args.tie_word_embeddings and not args.is_critic:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, positions, cu_seqlens):
        h = self.tok_embeddings(tokens)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, h.dtype)
        for block in self.layers.values():
            h = block(h, cos, sin, cu_seqlens)
        return self.output(self.norm(h))


class BaseStateDictAdapter:
    """HuggingFace <-> engine parameter names by regex templates (``{}`` = layer index).

    Subclasses set ``from_hf_map``: HF template -> engine template (None: dropped, e.g.
    rotary buffers). Tensors keep their layout (both sides store ``[out, in]``)."""

    from_hf_map: dict[str, str | None] = {}

    def __init__(self, args: BaseModelArgs):
        self.args = args
        self._to_engine = [(self._pattern(h), e) for h, e in self.from_hf_map.items()]
        self._to_hf = [(self._pattern(e), h) for h, e in self.from_hf_map.items() if e]

    @staticmethod
    def _pattern(template: str) -> re.Pattern:
        return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")

    @staticmethod
    def _convert(name: str, table) -> tuple[bool, str | None]:
        for pattern, target in table:
            m = pattern.match(name)
            if m:
                return True, (target.replace("{}", m.group(1)) if target and m.groups() else target)
        return False, None

    def to_engine_name(self, hf_name: str) -> str | None:
        found, out = self._convert(hf_name, self._to_engine)
        if not found:
            raise KeyError(f"{type(self).__name__}: no engine name for HF tensor {hf_name!r}")
        return out

    def to_hf_name(self, name: str) -> str:
        found, out = self._convert(name, self._to_hf)
        if not found:
            raise KeyError(f"{type(self).__name__}: no HF name for engine tensor {name!r}")
        return out

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in hf_state.items():
            name = self.to_engine_name(k)
            if name is not None:
                out[name] = v
        if self.args.tie_word_embeddings and "output.weight" not in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {self.to_hf_name(k): v for k, v in state.items()}
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
