"""``check_layout``: refuse a parallel layout the model cannot be split into, naming the
dimension and the allowed values (before any process starts, and again in the engine).

Outside ``areal.models.archon`` so that the controller checks a layout without importing
the archon models (DTensor and its sympy import: about 1.2 s of every trainer start)."""

from __future__ import annotations

from typing import Any

__all__ = ["allowed_sizes", "check_layout"]


def allowed_sizes(n: int) -> list[int]:
    """The divisors of ``n`` (the sizes that split ``n`` heads evenly)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(
    hf_config: Any, *, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1
) -> None:
    """ValueError when tp does not divide the attention or KV heads, cp does not divide
    the heads each tp rank holds, ep > 1 (or etp > 1) on a dense model, ep not dividing
    the experts, etp not dividing an expert's hidden size, or pp > 1 with tied embeddings
    or more stages than layers."""
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    mtype = getattr(hf_config, "model_type", "?")
    if heads % tp:
        raise ValueError(
            f"tensor parallel t{tp} does not divide the {heads} attention heads of this "
            f"{mtype} model; allowed t: {allowed_sizes(heads)}"
        )
    if kv % tp:
        raise ValueError(
            f"tensor parallel t{tp} does not divide the {kv} key/value heads of this "
            f"{mtype} model; allowed t: {[d for d in allowed_sizes(kv) if heads % d == 0]}"
        )
    if (heads // tp) % cp:
        raise ValueError(
            f"context parallel c{cp} does not divide the {heads // tp} attention heads per "
            f"tensor-parallel rank (heads {heads} / t{tp}); allowed c: "
            f"{allowed_sizes(heads // tp)}"
        )
    n_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if ep > 1 and n_experts == 0:
        raise ValueError(
            f"expert parallel e{ep} needs a mixture-of-experts model; this {mtype} model is "
            "dense; allowed e: [1]"
        )
    if ep > 1 and n_experts % ep:
        raise ValueError(
            f"expert parallel e{ep} does not divide the {n_experts} experts of this {mtype} "
            f"model; allowed e: {allowed_sizes(n_experts)}"
        )
    moe_hidden = int(getattr(hf_config, "moe_intermediate_size", 0) or 0)
    if etp > 1 and (n_experts == 0 or moe_hidden % etp):
        raise ValueError(
            f"expert tensor parallel ffn t{etp} does not divide the hidden size "
            f"{moe_hidden} of the experts of this {mtype} model; allowed ffn t: "
            f"{allowed_sizes(moe_hidden) if n_experts else [1]}"
        )
    if pp > 1 and bool(getattr(hf_config, "tie_word_embeddings", False)):
        raise ValueError(
            f"pipeline parallel p{pp}: a model with tied embeddings (tie_word_embeddings="
            "True) cannot be split into pipeline stages (the first and the last stage "
            "would share the weight); allowed p: [1]"
        )
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    if pp > layers:
        raise ValueError(
            f"pipeline parallel p{pp} needs at least one decoder layer per stage; this "
            f"{mtype} model has {layers}; allowed p: {list(range(1, layers + 1))}"
        )
