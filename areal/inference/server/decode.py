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
  (no repeat of the cache for grouped-query attention),
- optionally (:class:`SharedPrefix`) the prompt's keys/values stored once per distinct
  prompt: the n samples of a prompt attend to it in one matmul per (prompt, KV head),
  with the query heads of all its rows in the matmul's M dimension, and to their own
  generated tokens separately; the two parts are merged by their log-sum-exp (exact up to
  fp32 rounding). Reading the prompt's cache once instead of n times is what a decode step
  of a small model is bound by.

Only models whose structure is recognised are taken (:meth:`FastDecoder.build`), and the
core checks the first decode step against the Hugging Face forward
(:meth:`FastDecoder.matches_reference`); anything else keeps the HF path.
"""

from __future__ import annotations

import dataclasses

import torch

from areal.utils import logging

logger = logging.getLogger("LocalFastDecode")

_SUPPORTED = ("qwen2", "qwen3", "llama")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclasses.dataclass
class SharedPrefix:
    """Prompt keys/values shared by rows (see :meth:`FastDecoder.step`).

    ``keys``/``values``: per layer ``[slots, kv, cap, D]`` (slot ``s`` holds one prompt in
    its first columns); ``bias``: ``[slots, cap]`` additive (0 = attend, dtype min =
    padding); ``chunks``: ``(first_slot, end_slot, columns)`` ranges covering slots
    ``[0, S)``, each attended over its first ``columns`` columns (slots sorted by prompt
    length keep the padding small); ``gather``: ``[S * kv * M]`` indices into the decode
    step's ``[B * kv]`` (row, KV head) pairs: slot ``s``'s ``m``-th row for KV head ``h`` at
    ``(s * kv + h) * M + m`` (unused places point anywhere valid); ``scatter``:
    ``[B * kv]``, the inverse (rows without a slot point anywhere valid: their output is
    never read).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    bias: torch.Tensor
    gather: torch.Tensor
    scatter: torch.Tensor
    rows_per_slot: int
    chunks: list[tuple[int, int, int]]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[N, H, L, D]`` (already scaled) over ``k``/``v``
    ``[N, H, S, D]`` with the additive ``bias`` (broadcast to ``[N, H, L, S]``): the output
    and its log-sum-exp ``[N, H, L]``. On CPU PyTorch's fused flash kernel (no score matrix
    in memory), elsewhere the plain formula."""
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        out, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=bias, scale=1.0)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)).add_(bias)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v), lse


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token per row.

        ``tokens``/``positions``: ``[B]``; ``kbufs``/``vbufs``: per layer ``[B, kv, cap, D]``
        holding the cache in columns ``[0, T)``; the new key/value go to column ``T``.
        ``mask``: ``[B, T + 1]`` (1 = attend) including the new column. ``segments``:
        ``(row_start, row_end, first_column)`` blocks whose rows attend only to columns
        ``[first_column, T]`` (the columns before are padding for every row of the block);
        rows in no block get a zero attention output (free rows). Default: one block of
        every row from column 0. ``prefix``: keys/values every row attends to besides its
        own columns (its prompt, shared by the rows of one slot); see :class:`SharedPrefix`.
        """
        if prefix is not None:
            return self._step_shared(tokens, positions, kbufs, vbufs, T, mask, segments, prefix)
        B = tokens.shape[0]
        D, NH = self.head_dim, self.n_heads
        if segments is None:
            segments = [(0, B, 0)]
        h, cos, sin, seg_bias = self._prologue(tokens, positions, mask, T, segments)
        full = len(segments) == 1 and segments[0][:2] == (0, B)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kb, vb = kbufs[i], vbufs[i]
            q = self._project(layer, h, cos, sin, kb, vb, T)  # [B, KV, G, D]
            o = torch.empty_like(q) if full else torch.zeros_like(q)
            for (r0, r1, c0), sb in zip(segments, seg_bias):
                scores = torch.matmul(q[r0:r1], kb[r0:r1, :, c0 : T + 1].transpose(-1, -2))
                probs = torch.softmax(scores.add_(sb), dim=-1)  # [rows, KV, G, cols]
                torch.matmul(probs, vb[r0:r1, :, c0 : T + 1], out=o[r0:r1])
            h = h + attn.o_proj(o.view(B, NH * D))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h))

    def _prologue(self, tokens, positions, mask, T, segments):
        """Embeddings, rotary tables and each row segment's additive mask bias."""
        B = tokens.shape[0]
        h = self.embed(tokens)  # [B, H]
        cos, sin = self.rotary(h, positions.unsqueeze(1))  # [B, 1, D]
        bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device)
        bias.masked_fill_(mask == 0, torch.finfo(h.dtype).min)
        bias = bias.view(B, 1, 1, T + 1)
        return h, cos, sin, [bias[r0:r1, :, :, c0:] for r0, r1, c0 in segments]

    def _project(self, layer, h, cos, sin, kb, vb, T):
        """One layer's rotated, scaled queries ``[B, KV, G, D]``; its new keys and values
        are written into column ``T`` of the layer's buffers ``kb``/``vb``."""
        B = h.shape[0]
        D, G, KV, NH = self.head_dim, self.group, self.n_kv, self.n_heads
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
        kb[:, :, T] = qk[:, NH:]
        vb[:, :, T] = v.view(B, KV, D)
        return (qk[:, :NH] * self.scaling).view(B, KV, G, D)

    def _step_shared(self, tokens, positions, kbufs, vbufs, T, mask, segments, prefix):
        B = tokens.shape[0]
        D, G, KV, NH = self.head_dim, self.group, self.n_kv, self.n_heads
        S = prefix.chunks[-1][1]
        M = prefix.rows_per_slot
        if segments is None:
            segments = [(0, B, 0)]
        h, cos, sin, seg_bias = self._prologue(tokens, positions, mask, T, segments)
        gather, scatter = prefix.gather, prefix.scatter
        chunk_bias = [prefix.bias[s0:s1, None, None, :P] for s0, s1, P in prefix.chunks]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kb, vb = kbufs[i], vbufs[i]
            q = self._project(layer, h, cos, sin, kb, vb, T).view(B * KV, G, D)
            # The prompt part: each slot's rows (x query heads) as one query block.
            qs = q.index_select(0, gather).view(S, KV, M * G, D)
            pk, pv = prefix.keys[i], prefix.values[i]
            parts = [
                attend(qs[s0:s1], pk[s0:s1, :, :P], pv[s0:s1, :, :P], cb)
                for (s0, s1, P), cb in zip(prefix.chunks, chunk_bias)
            ]
            parts = [torch.cat((op, lp.unsqueeze(-1)), dim=-1) for op, lp in parts]
            stats = parts[0] if len(parts) == 1 else torch.cat(parts)
            stats = stats.view(S * KV * M, G, D + 1)
            stats = stats.index_select(0, scatter).view(B, KV, G, D + 1)
            # The own part: each row against its generated tokens (blocks of rows).
            q = q.view(B, KV, G, D)
            o_s = torch.zeros_like(q)
            l_s = torch.full((B, KV, G, 1), -float("inf"), dtype=q.dtype, device=q.device)
            for (r0, r1, c0), sb in zip(segments, seg_bias):
                os_, ls_ = attend(q[r0:r1], kb[r0:r1, :, c0 : T + 1], vb[r0:r1, :, c0 : T + 1], sb)
                o_s[r0:r1] = os_
                l_s[r0:r1] = ls_.unsqueeze(-1)
            # Merge the two normalised parts by their log-sum-exp.
            lse = torch.logaddexp(stats[..., D:], l_s)
            o = stats[..., :D].mul((stats[..., D:] - lse).exp_()).add_(o_s.mul_((l_s - lse).exp_()))
            # (the prompt part's kernel answers in float32: back to the weights' dtype)
            h = h + attn.o_proj(o.view(B, NH * D).to(h.dtype))
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
