"""Log-probabilities and entropies computed inside the model's forward, chunk by chunk
(``ChunkedLogprobHead`` replaces ``lm_head`` and keeps its weight), so no
``[tokens, vocab]`` logits tensor is held for long micro-batches.

Each chunk runs :class:`_LinearLogprobEntropy`, one autograd node for
``hidden -> (log p(label), entropy)``: forward keeps only the chunk's log-sum-exp,
backward recomputes the chunk's logits and forms the gradient ``g * (onehot - softmax)``
in place. Against autograd over ``linear -> log_softmax -> gather`` (with activation
checkpointing per chunk) this drops the backward's ``[rows, vocab]`` zero fill and
scatter, the log-softmax backward and the forward's second log-softmax: on SmolLM2-135M
(49,152-token vocabulary) the head's elementwise work is about a third of what it was
(``benchmarks/bench_logprob_head.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    # fp32 logits even when the layers run in bf16 (mixed precision): log-probabilities
    # are compared with the inference server's, and bf16 logits are off by ~1e-2
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _LinearLogprobEntropy(torch.autograd.Function):
    """``(log softmax(h W^T + b)/T)[label]`` and the entropy of that distribution, per row.

    The entropy carries no gradient (monitoring and filtering only)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature):
        logits = _chunk_logits(hidden, weight, bias, temperature)
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
        # entropy = lse - sum_v p_v z_v, with p = exp(z - lse) (z kept for the dot product)
        probs = torch.exp(logits - lse.unsqueeze(-1))
        entropy = lse - torch.bmm(probs.unsqueeze(1), logits.unsqueeze(-1)).view(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        # d logp / d z = onehot(label) - softmax(z); z = (h W^T + b) / T
        grad = _chunk_logits(hidden, weight, bias, t)
        grad.sub_(lse.unsqueeze(-1)).exp_()
        g = grad_logp.float() / t
        grad.mul_(-g.unsqueeze(-1))
        grad.scatter_add_(-1, labels.unsqueeze(-1), g.unsqueeze(-1))
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad @ weight.float()).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad.t() @ hidden.float()).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


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
    ``[chunk_size, vocab]`` fp32 logits block exists at a time, in forward and in
    backward (which recomputes it).
    """
    n = hidden.shape[0]
    logps, ents = [], []
    for s in range(0, max(n, 1), chunk_size):
        lp, ent = _LinearLogprobEntropy.apply(
            hidden[s : s + chunk_size], weight, bias, labels[s : s + chunk_size], float(temperature)
        )
        logps.append(lp)
        ents.append(ent)
    if len(logps) == 1:
        return logps[0], ents[0]
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
