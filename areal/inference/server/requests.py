"""Requests of the built-in server's generation core: parameters, one request, the error.

- ``SamplingParams``: a request's sampling parameters (``from_dict`` takes the HTTP
  payload's ``sampling_params``; ``validate`` raises ``RequestError``);
- ``Request``: one request inside the core (prompt, outputs so far, its sampling seed);
- ``RequestError``: a request the core refuses (HTTP 400).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GREEDY_TEMPERATURE_EPS", "Request", "RequestError", "SamplingParams"]

# Temperatures below this are treated as greedy decoding (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5


class RequestError(ValueError):
    """A request the core refuses (maps to HTTP 400)."""


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    greedy: bool = False
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    # Per-request sampling seed: the same seed gives the same tokens whatever else is in
    # the batch (a resumed run regenerates exactly what the crashed one would have).
    seed: int | None = None
    # MoE models: return per token the experts it was routed to (routing replay)
    return_routed_experts: bool = False
    # Computed alone (one request per forward, no shared prefill or prompt LRU): its
    # arithmetic does not depend on which other requests are running (deterministic runs)
    deterministic: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise RequestError(
                f"unknown sampling parameter(s) {sorted(unknown)}; allowed: {sorted(known)}"
            )
        try:
            sp = cls(**d)
            sp.max_new_tokens = int(sp.max_new_tokens)
            sp.min_new_tokens = int(sp.min_new_tokens)
            sp.temperature = float(sp.temperature)
            sp.top_p = float(sp.top_p)
            sp.top_k = int(sp.top_k) if sp.top_k is not None else -1
            sp.greedy = bool(sp.greedy)
            sp.ignore_eos = bool(sp.ignore_eos)
            sp.return_routed_experts = bool(sp.return_routed_experts)
            sp.deterministic = bool(sp.deterministic)
            sp.stop_token_ids = [int(t) for t in (sp.stop_token_ids or [])]
            sp.seed = None if sp.seed is None else int(sp.seed)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad sampling parameters: {e}") from e
        sp.validate()
        return sp

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens={self.max_new_tokens}; must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens={self.min_new_tokens}; must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(
                f"temperature={self.temperature}; must be a finite number >= 0 (0 = greedy)"
            )
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            # As vLLM: a temperature this small is greedy decoding (dividing the logits by
            # it would overflow to inf and give NaN logprobs).
            self.greedy = True
            self.temperature = 1.0
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p}; must be in (0, 1]")


@dataclasses.dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    callback: Callable[[dict[str, Any]], None]
    stop_set: frozenset[int]
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_versions: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    abort_requested: bool = False
    done: bool = False
    finish: str = ""
    # Vision-language models: {"pixel_values", "image_grid_thw"} of the prompt's images.
    mm: dict[str, Any] | None = None
    # The seed of a sampled request's random stream (``sampling.seeded_uniforms``), or None.
    stream_seed: int | None = dataclasses.field(default=None, init=False)
    plain: bool = dataclasses.field(default=False, init=False)
    # return_routed_experts: [tokens, n_moe_layers, top_k] blocks (prompt, then per step)
    routed: list[torch.Tensor] = dataclasses.field(default_factory=list, init=False)
    # Greedy requests identical to this one (same prompt and stopping rules): decoded
    # once, in this request's row; each gets a copy of every token (``greedy_key``).
    followers: list[Request] = dataclasses.field(default_factory=list, init=False)

    def __post_init__(self):
        p = self.params
        if p.seed is not None and not p.greedy:
            self.stream_seed = p.seed % (2**64)
        # Plain sampling (no top-k/top-p truncation, seeded or not): the whole batch is
        # sampled with a few tensor ops when every row is plain (see ``sample_tokens``).
        self.plain = not p.greedy and p.top_k <= 0 and p.top_p >= 1.0

    def greedy_key(self) -> tuple | None:
        """What fixes a greedy request's output (prompt, length limits, stop set), or
        ``None`` when it is not a text-only greedy request: requests with equal keys get
        identical tokens and logprobs, so the core decodes them once."""
        p = self.params
        if not p.greedy or self.mm is not None or p.return_routed_experts or p.deterministic:
            return None
        return (tuple(self.input_ids), p.max_new_tokens, p.min_new_tokens, self.stop_set)
