"""Sampling of the built-in server: one token per running row from the step's logits.

``sample_tokens`` applies each request's temperature, min-new-tokens stop masking,
top-k / top-p truncation and seeded generator, batched (a batch of plain rows takes a few
tensor ops); ``draw`` samples from probabilities. The logprob convention is the core's
(``areal.engine.local_server.core``): ``log_softmax(logits / temperature)`` of the sampled
token before truncation and masking, ``log_softmax(logits)`` under greedy decoding.
"""

from __future__ import annotations

import torch

from areal.engine.local_server.requests import Request

__all__ = ["draw", "sample_tokens"]

_INF = float("inf")


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (rows need not be normalised) by inverse CDF: one
    uniform number per row (``torch.multinomial`` draws one per vocabulary entry on CPU,
    ~15x slower here)."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
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
        tokens = draw(logp.exp())
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
        probs = torch.softmax(s_logits, dim=-1)
        drawn = torch.empty(len(s_reqs), dtype=torch.long, device=dev)
        seeded = [i for i, r in enumerate(s_reqs) if r.generator is not None]
        unseeded = [i for i, r in enumerate(s_reqs) if r.generator is None]
        if unseeded:
            drawn[unseeded] = draw(probs[unseeded])
        for i in seeded:  # one draw per seeded request from its own generator
            drawn[i] = torch.multinomial(probs[i], 1, generator=s_reqs[i].generator)[0]
        tokens[samp] = drawn
    token_logp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, token_logp
