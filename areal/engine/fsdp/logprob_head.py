"""Log-probabilities and entropies computed inside the model's forward, chunk by chunk
(``ChunkedLogprobHead`` replaces ``lm_head`` and keeps its weight), so no
``[tokens, vocab]`` logits tensor is held for long micro-batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _logprob_entropy_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 logits even when the layers run in bf16 (mixed precision): log-probabilities
    # are compared with the inference server's, and bf16 logits are off by ~1e-2
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(labels[i] | hidden[i])`` and the entropy at each row, ``chunk_size`` rows at a time.

    ``hidden`` ``[N, H]``, ``labels`` ``[N]`` -> two float32 ``[N]`` tensors; the
    entropy carries no gradient (it is for monitoring and filtering). Only one
    ``[chunk_size, vocab]`` fp32 logits block exists at a time; with autograd enabled each
    chunk is recomputed in backward (activation checkpointing) instead of keeping its
    logits.
    """
    n = hidden.shape[0]
    if n <= chunk_size:
        return _logprob_entropy_chunk(hidden, weight, bias, labels, temperature)
    logps, ents = [], []
    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, n, chunk_size):
        h, y = hidden[s : s + chunk_size], labels[s : s + chunk_size]
        if use_ckpt:
            lp, ent = checkpoint(
                _logprob_entropy_chunk, h, weight, bias, y, temperature, use_reentrant=False
            )
        else:
            lp, ent = _logprob_entropy_chunk(h, weight, bias, y, temperature)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


class ChunkedLogprobHead(nn.Module):
    """Drop-in replacement of a causal LM's ``lm_head`` that can return logprobs directly.

    It holds the *same* ``weight`` (and ``bias``) Parameter objects as the head it
    replaces, so state-dict keys, tied embeddings and FSDP sharding are unchanged. Without
    a pending request it is a plain linear layer (logits). With ``request(labels,
    temperature)`` set, the model's forward returns ``logits`` of shape ``[1, N, 2]``
    holding (logprob of ``labels[i]`` at row i, entropy at row i), computed in chunks, so
    the full ``[N, vocab]`` logits never exist. The whole computation stays inside the
    root module's forward, where FSDP has the head's parameters unsharded.
    """

    def __init__(self, head: nn.Linear, chunk_size: int = 1024, chunk_bytes: int = 128 << 20):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.in_features = getattr(head, "in_features", head.weight.shape[1])
        self.out_features = getattr(head, "out_features", head.weight.shape[0])
        # Rows per chunk: at least chunk_size, more while one fp32 [rows, vocab] block
        # stays under chunk_bytes (no need to chunk when the logits are small).
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes
        self._labels: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._temperature = 1.0

    def request(
        self,
        labels: torch.Tensor | None,
        temperature: float = 1.0,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Return logprobs of ``labels`` from the next forward; ``rows`` (optional) picks
        the hidden row that scores each label (``labels[i]`` is scored by ``hidden[rows[i]]``,
        e.g. a shared prefix's last row for every member's first own token)."""
        self._labels = labels
        self._rows = rows
        self._temperature = float(temperature)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            return F.linear(hidden, self.weight, self.bias)
        if hidden.dim() != 3 or hidden.shape[0] != 1:
            raise ValueError(f"packed forward expects hidden [1, N, H], got {tuple(hidden.shape)}")
        rows = max(self.chunk_size, self.chunk_bytes // (4 * max(1, self.out_features)))
        h = hidden[0] if self._rows is None else hidden[0].index_select(0, self._rows)
        logp, ent = chunked_logprobs_entropy(
            h, self.weight, self.bias, self._labels, self._temperature, rows
        )
        return torch.stack([logp, ent], dim=-1).unsqueeze(0)
