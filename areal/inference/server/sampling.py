"""Sampling of the built-in server: one token per running row from the step's logits.

``sample_tokens`` applies each request's temperature, min-new-tokens stop masking,
top-k / top-p truncation and seed, batched (a batch of plain rows takes a few tensor
ops); ``draw`` samples from probabilities by inverse CDF, one uniform number per row.

A seeded request's uniform number for its n-th token is a hash of (seed, n)
(``seeded_uniforms``: SplitMix64, a counter-based generator): the same seed gives the same
tokens whatever else is in the batch, and a whole batch of seeded rows is drawn together
(a ``torch.Generator`` per request meant one ``torch.multinomial`` call per row and step).

The logprob convention is the core's (``areal.inference.server.core``):
``log_softmax(logits / temperature)`` of the sampled token before truncation and
masking, ``log_softmax(logits)`` under greedy decoding.
"""

from __future__ import annotations

import numpy as np
import torch

from areal.inference.server.requests import Request

__all__ = ["draw", "sample_tokens", "seeded_uniforms"]

_INF = float("inf")
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: list[int], counts: list[int]) -> torch.Tensor:
    """Uniform numbers in [0, 1) (float64), the ``counts[i]``-th of stream ``seeds[i]``:
    a pure function of (seed, count), so independent of the batch and of the order."""
    with np.errstate(over="ignore"):
        base = _mix64(np.asarray(seeds, dtype=np.uint64))
        z = _mix64(base + (np.asarray(counts, dtype=np.uint64) + np.uint64(1)) * _GAMMA)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def _uniforms(reqs: list[Request], gen_counts: list[int]) -> torch.Tensor:
    """One uniform number per row (float64, CPU): seeded rows from their own stream at
    their token count, the others from torch's global generator."""
    u = torch.rand(len(reqs), dtype=torch.float64)
    seeded = [i for i, r in enumerate(reqs) if r.stream_seed is not None]
    if seeded:
        u[seeded] = seeded_uniforms(
            [reqs[i].stream_seed for i in seeded], [gen_counts[i] for i in seeded]
        )
    return u


def draw(probs: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (rows need not be normalised) by inverse CDF, with
    the row's uniform number from ``u`` (default: fresh ones); ``torch.multinomial`` draws
    one number per vocabulary entry on CPU, ~15x slower here."""
    cdf = probs.double().cumsum(dim=-1)
    if u is None:
        u = torch.rand(probs.shape[0], dtype=torch.float64)
    u = u.to(device=probs.device, dtype=torch.float64).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample_tokens(
    logits: torch.Tensor, reqs: list[Request], gen_counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens [B], logprobs [B]) per the module convention."""
    logits = logits.float()
    B, V = logits.shape
    dev = logits.device
    unmasked = not any(r.params.min_new_tokens > c and r.stop_set for r, c in zip(reqs, gen_counts))
    if unmasked and all(r.params.greedy for r in reqs):  # no scaling, no masks, no copies
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if unmasked and all(r.plain for r in reqs):
        temps = [r.params.temperature for r in reqs]
        scaled = logits
        if any(t != 1.0 for t in temps):
            scaled = logits / torch.tensor(temps, device=dev).unsqueeze(1)
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = draw(logp.exp(), _uniforms(reqs, gen_counts))
        return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    greedy = torch.tensor([r.params.greedy for r in reqs], device=dev)
    temps = torch.tensor(
        [1.0 if r.params.greedy else r.params.temperature for r in reqs], device=dev
    )
    scaled = logits / temps.unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    # Stop tokens are not allowed before min_new_tokens.
    masked = None
    for b, r in enumerate(reqs):
        if r.params.min_new_tokens > gen_counts[b] and r.stop_set:
            if masked is None:
                masked = scaled.clone()
            masked[b, list(r.stop_set)] = -_INF
    work = scaled if masked is None else masked
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    if bool(greedy.any()):
        tokens[greedy] = work[greedy].argmax(dim=-1)
    samp = ~greedy
    if bool(samp.any()):
        s_logits = work[samp]
        s_reqs = [r for r, g in zip(reqs, greedy.tolist()) if not g]
        top_k = torch.tensor(
            [r.params.top_k if 0 < r.params.top_k < V else V for r in s_reqs], device=dev
        )
        top_p = torch.tensor([r.params.top_p for r in s_reqs], device=dev)
        if bool((top_k < V).any()) or bool((top_p < 1).any()):
            sorted_logits, sorted_idx = torch.sort(s_logits, dim=-1, descending=True)
            ranks = torch.arange(V, device=dev).unsqueeze(0)
            remove = ranks >= top_k.unsqueeze(1)
            probs = torch.softmax(sorted_logits.masked_fill(remove, -_INF), dim=-1)
            cum = probs.cumsum(dim=-1) - probs  # mass strictly before this token
            remove = remove | (cum >= top_p.unsqueeze(1))
            remove[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(remove, -_INF)
            s_logits = torch.full_like(s_logits, -_INF).scatter(1, sorted_idx, sorted_logits)
        s_counts = [c for c, g in zip(gen_counts, greedy.tolist()) if not g]
        tokens[samp] = draw(torch.softmax(s_logits, dim=-1), _uniforms(s_reqs, s_counts))
    token_logp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, token_logp
