"""Fast decode step for Llama-style decoder-only text models (Qwen2, Qwen3, Llama).

The built-in server's decode step feeds one token per running row. Going through the
Hugging Face forward for that costs far more than the arithmetic at small model sizes: a
cache object per step, a 4-D attention mask built per step, rotary embeddings per layer,
and ``scaled_dot_product_attention``'s CPU flash kernel, which is slow for a single query
row. :class:`FastDecoder` runs the same modules (embedding, norms, projections, MLP, head:
the model's own ``nn.Module`` objects, so in-place weight updates and merged LoRA adapters
are seen at once) with its own glue:

- rotary cos/sin once per step (the model's own rotary module, so every rope type works),
- one additive mask bias per step shared by all layers,
- the new key/value written in place into the server's preallocated buffers,
- attention as two batched matmuls per layer with the query heads grouped per KV head
  (no repeat of the cache for grouped-query attention).

Only models whose structure is recognised are taken (:meth:`FastDecoder.build`), and the
core checks the first decode step against the Hugging Face forward
(:meth:`FastDecoder.matches_reference`); anything else keeps the HF path.
"""

from __future__ import annotations

import torch

from areal.utils import logging

logger = logging.getLogger("LocalFastDecode")

_SUPPORTED = ("qwen2", "qwen3", "llama")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastDecoder:
    """One decode step over preallocated KV buffers; see the module docstring."""

    def __init__(self, model: torch.nn.Module):
        inner = model.model
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.group = self.n_heads // self.n_kv
        self.scaling = float(attn.scaling)
        self.qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")

    @classmethod
    def build(cls, model: torch.nn.Module) -> FastDecoder | None:
        """A decoder for ``model``, or ``None`` when its structure is not one we know."""
        cfg = getattr(model, "config", None)
        model_type = getattr(cfg, "model_type", None)
        if model_type not in _SUPPORTED:
            return None
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "rotary_emb", "norm", "layers")
        if inner is None or not all(hasattr(inner, a) for a in needed):
            return None
        if not hasattr(model, "lm_head"):
            return None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            if any(t != "full_attention" for t in layer_types):
                return None
        elif getattr(cfg, "sliding_window", None):
            return None
        if getattr(cfg, "final_logit_softcapping", None) or getattr(
            cfg, "attn_logit_softcapping", None
        ):
            return None
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(
                hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")
            ):
                return None
            if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm")):
                return None
            if not hasattr(layer, "mlp"):
                return None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            return None
        return cls(model)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kbufs: list[torch.Tensor],
        vbufs: list[torch.Tensor],
        T: int,
        mask: torch.Tensor,
        segments: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token per row.

        ``tokens``/``positions``: ``[B]``; ``kbufs``/``vbufs``: per layer ``[B, kv, cap, D]``
        holding the cache in columns ``[0, T)``; the new key/value go to column ``T``.
        ``mask``: ``[B, T + 1]`` (1 = attend) including the new column. ``segments``:
        ``(row_start, row_end, first_column)`` blocks whose rows attend only to columns
        ``[first_column, T]`` (the columns before are padding for every row of the block);
        rows in no block get a zero attention output (free rows). Default: one block of
        every row from column 0.
        """
        B = tokens.shape[0]
        D, G, KV, NH = self.head_dim, self.group, self.n_kv, self.n_heads
        if segments is None:
            segments = [(0, B, 0)]
        h = self.embed(tokens)  # [B, H]
        cos, sin = self.rotary(h, positions.unsqueeze(1))  # [B, 1, D]
        bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device)
        bias.masked_fill_(mask == 0, torch.finfo(h.dtype).min)
        bias = bias.view(B, 1, 1, T + 1)
        seg_bias = [bias[r0:r1, :, :, c0:] for r0, r1, c0 in segments]
        full = len(segments) == 1 and segments[0][:2] == (0, B)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, NH, D)
            k = attn.k_proj(x).view(B, KV, D)
            v = attn.v_proj(x)
            if self.qk_norm:
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            qk = torch.cat((q, k), dim=1)  # rotary on queries and keys at once
            qk = qk * cos + _rotate_half(qk) * sin
            q = (qk[:, :NH] * self.scaling).view(B, KV, G, D)
            kb, vb = kbufs[i], vbufs[i]
            kb[:, :, T] = qk[:, NH:]
            vb[:, :, T] = v.view(B, KV, D)
            o = torch.empty_like(q) if full else torch.zeros_like(q)
            for (r0, r1, c0), sb in zip(segments, seg_bias):
                scores = torch.matmul(q[r0:r1], kb[r0:r1, :, c0 : T + 1].transpose(-1, -2))
                probs = torch.softmax(scores.add_(sb), dim=-1)  # [rows, KV, G, cols]
                torch.matmul(probs, vb[r0:r1, :, c0 : T + 1], out=o[r0:r1])
            h = h + attn.o_proj(o.view(B, NH * D))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))

    def matches_reference(self, logits: torch.Tensor, reference: torch.Tensor) -> bool:
        """Whether the fast path's logits agree with the HF forward's (fp32: within 1e-3;
        half precision: within 5e-2 + 2% relative, its own rounding)."""
        tol = 1e-3 if logits.dtype == torch.float32 else 5e-2
        rtol = 1e-3 if logits.dtype == torch.float32 else 2e-2
        ok = logits.shape == reference.shape and bool(
            torch.allclose(logits.float(), reference.float(), atol=tol, rtol=rtol)
        )
        if not ok:
            diff = (logits.float() - reference.float()).abs().max().item()
            logger.warning(
                "fast decode path disagrees with the model's forward (max |diff| %.3g); "
                "using the Hugging Face forward for %s",
                diff,
                type(self.model).__name__,
            )
        return ok
