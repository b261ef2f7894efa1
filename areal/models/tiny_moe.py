"""The tiny mixture-of-experts model: tiny-base's tokenizer and task, a Qwen3-MoE decoder.

hidden 128, 4 layers, 4 heads, 2 KV heads, tied embeddings, 4 experts per layer of
intermediate 128 with top-2 routing (normalised), about 1.03M parameters (~4.1 MB fp32).

- :func:`tiny_moe_config` returns the ``Qwen3MoeConfig``.
- :func:`get_tiny_moe_path` is the shipped checkpoint (``areal/models/assets/tiny-moe``;
  rebuilt by ``examples/math/build_tiny_moe.py``: upcycled from tiny-base, then SFT on
  tiny-base's task).
"""

from __future__ import annotations

from pathlib import Path

from areal.models.tiny import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, TINY_VOCAB_SIZE

__all__ = ["get_tiny_moe_path", "tiny_moe_config"]

_ASSETS = Path(__file__).resolve().parent / "assets"


def get_tiny_moe_path() -> str:
    """Directory of the shipped tiny MoE checkpoint (config, safetensors, tokenizer)."""
    path = _ASSETS / "tiny-moe"
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"tiny MoE checkpoint missing at {path}; rebuild it with "
            "`python examples/math/build_tiny_moe.py`"
        )
    return str(path)


def tiny_moe_config(vocab_size: int = TINY_VOCAB_SIZE, **overrides):
    """``Qwen3MoeConfig`` of the tiny MoE (module docstring); ``overrides`` replace any field.

    ``attention_bias=True`` keeps tiny-base's q/k/v biases when upcycling (o_proj gets a
    zero bias); every layer is sparse."""
    from transformers import Qwen3MoeConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        attention_bias=True,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        use_cache=True,
        torch_dtype="float32",
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)
