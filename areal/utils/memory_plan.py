"""Memory arithmetic for planning a run: model shapes and layouts in, bytes per item out.

Pure functions (no torch, no files): ``ModelShape.from_hf_config`` reads a ``config.json``
mapping, ``trainer_rank_memory`` gives one training rank's items (parameters, gradients,
optimizer states, activations of one micro-batch), ``server_memory`` one inference
server's (weights, KV cache), ``weight_sync_bytes`` what one weight push moves.

The activation terms are counted per token and per decoder layer from the tensors the
HF Qwen2/Llama decoder keeps for backward (layer input, two RMSNorm outputs and their
fp32 intermediates, q/k/v after rotary, the attention output and its contiguous copy, the
MLP's gate, up, SiLU and product), then scaled by ``ACT_CALIBRATION``, the ratio measured
on CPU with SDPA attention (``benchmarks/bench_planner.py``): the allocator's slack and
the backward's transient gradients of activations. With gradient checkpointing only each
layer's input is kept, plus two layers' sets (the layer being recomputed and the
gradients of its activations).

The server's items: weights, the KV cache of every running request at full length, the
prompt-prefix LRU of the built-in server (capped), and the prefill transient of one
admission (its fresh KV before the merge into the running batch, and the MLP's gate and
up projections of the prefilled tokens), plus the decode step's fp32 logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
# Measured / counted activation bytes (CPU, fp32, SDPA, benchmarks/bench_planner.py).
ACT_CALIBRATION = 1.1
# fp32 [chunk, vocab] blocks alive at the peak of the chunked log-prob head's backward
# (logits, log_softmax, their gradients).
LOGIT_BLOCKS = 3.0
LOGPROB_CHUNK = 1024  # rows per chunk of areal.engine.fsdp.logprob_head
# A trainer rank's constant slack measured on CPU (allocator arenas, autograd bookkeeping).
RUNTIME_OVERHEAD = 32 * 2**20


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Qwen2 / Llama / Qwen3 and their MoE kin)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int = 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        """From an HF ``config.json`` mapping (text part of a VLM config when nested)."""
        cfg = dict(cfg.get("text_config") or cfg) if isinstance(cfg, dict) else cfg
        need = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"model config lacks {missing}; needed: {list(need)}")
        heads = int(cfg["num_attention_heads"])
        model_type = str(cfg.get("model_type", ""))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type.startswith("qwen2") or bool(cfg.get("attention_bias", False)),
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
            if self.shared_expert_intermediate_size:
                mlp += 3 * h * self.shared_expert_intermediate_size + h
        else:
            mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def n_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def act_elems_per_token_layer(self) -> int:
        """Elements one token keeps per decoder layer for backward (module docstring)."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        inter = self.moe_intermediate_size * 2 if self.num_experts else self.intermediate_size
        return 6 * h + 3 * q + 2 * kv + 4 * inter


@dataclass(frozen=True)
class TrainLayout:
    """How one training component's ranks split the model: FSDP shards over ``dp``
    (and ``cp``, as torchtitan's FSDP mesh does); ``tp`` splits each layer's weights and
    activations; ``cp`` splits the tokens of a micro-batch; ``ep`` is folded into the
    expert shards (experts are spread over ep x the rest of dp*cp*tp)."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainLayout.{f.name}={v!r}; allowed: an integer >= 1")

    @property
    def param_shards(self) -> int:
        return self.dp * self.cp * self.tp


def trainer_rank_memory(
    shape: ModelShape,
    layout: TrainLayout,
    tokens_per_mb: int,
    gradient_checkpointing: bool,
    optimizer: str = "adam",
    param_bytes: int = 4,
    compute_bytes: int = 4,
    trainable: bool = True,
) -> dict[str, int]:
    """Bytes per training rank, by item. ``param_bytes``: the sharded (master) parameters,
    fp32 in FSDPEngine; ``compute_bytes``: the dtype of forward/backward (bf16 on GPU).
    ``trainable=False`` (a reference model): parameters and forward-only activations."""
    if tokens_per_mb < 1:
        raise ValueError(f"tokens_per_mb={tokens_per_mb!r}; allowed: an integer >= 1")
    if optimizer not in ("adam", "sgd", "adam_bf16"):
        raise ValueError(f"optimizer={optimizer!r}; allowed: ['adam', 'adam_bf16', 'sgd']")
    n = shape.n_params()
    shards = layout.param_shards
    items = {"parameters": n * param_bytes // shards}
    if compute_bytes != param_bytes or shards > 1:
        # FSDP all-gathers one layer at a time in the compute dtype, and prefetches the next
        gathered = max(shape.layer_params(), shape.vocab_size * shape.hidden_size)
        items["gathered parameters"] = 2 * gathered * compute_bytes // layout.tp
    tokens = -(-tokens_per_mb // layout.cp)
    per_layer = shape.act_elems_per_token_layer() * compute_bytes * tokens // layout.tp
    logits = LOGIT_BLOCKS * min(tokens, LOGPROB_CHUNK) * shape.vocab_size * 4 // layout.tp
    if not trainable:
        items["activations"] = int(ACT_CALIBRATION * 2 * per_layer + logits)
        return items
    items["gradients"] = n * 4 // shards
    state = {"adam": 2 * 4, "adam_bf16": 2 * 2, "sgd": 0}[optimizer]
    items["optimizer states"] = n * state // shards
    if gradient_checkpointing:
        kept = shape.num_layers * shape.hidden_size * compute_bytes * tokens // layout.tp
        kept += 2 * per_layer
    else:
        kept = shape.num_layers * per_layer
    # AdamW(foreach) allocates one parameter-sized temporary in step(); activations are
    # gone by then, so the larger of the two is the peak.
    step_tmp = n * 4 // shards if optimizer != "sgd" else 0
    items["activations"] = int(max(ACT_CALIBRATION * kept + logits, step_tmp))
    items["runtime overhead"] = RUNTIME_OVERHEAD
    return items


def server_memory(
    shape: ModelShape,
    weight_bytes: int,
    kv_bytes: int,
    concurrency: int,
    prompt_len: int,
    max_new_tokens: int,
    tp: int = 1,
    max_prefill_tokens: int = 4096,
    prompt_cache_bytes: int = 64 * 2**20,
) -> dict[str, int]:
    """Bytes per inference server instance (``tp`` devices split it evenly: per device
    divide by ``tp``). Defaults are the built-in server's (``GenerationCore``):
    ``max_prefill_tokens`` per admission, a prompt LRU of ``prompt_cache_bytes`` (0 for
    vLLM/SGLang, whose prefix caches live inside their KV pool)."""
    for name, v in (
        ("concurrency", concurrency),
        ("prompt_len", prompt_len),
        ("max_new_tokens", max_new_tokens),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}; allowed: an integer >= 1")
    per_tok = shape.kv_bytes_per_token(kv_bytes)
    prefill = min(concurrency * prompt_len, max_prefill_tokens)
    inter = shape.moe_intermediate_size * 2 if shape.num_experts else shape.intermediate_size
    items = {
        "weights": shape.n_params() * weight_bytes,
        "kv cache": per_tok * concurrency * (prompt_len + max_new_tokens),
        "prompt cache": min(prompt_cache_bytes, per_tok * concurrency * prompt_len),
        "prefill transient": prefill * (per_tok + (2 * inter + shape.hidden_size) * kv_bytes),
        "decode logits": concurrency * shape.vocab_size * 4 * 2,
    }
    return {k: v // tp for k, v in items.items()}


def weight_sync_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """What one weight push moves to every inference server: the full model once."""
    return shape.n_params() * dtype_bytes


def largest_item(items: dict[str, int]) -> tuple[str, int]:
    name = max(items, key=lambda k: items[k])
    return name, items[name]
