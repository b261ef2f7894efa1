"""Mixture-of-experts routing carried from the inference server to the trainer.

With ``rollout.return_routed_experts`` every generation chunk brings, per position it
ran, the experts the model routed that position to; the trainer's routing replay
(``archon.router_replay``) uses them so the policy ratio compares the same experts.

- ``splice_routing``: the rows of a request after one more chunk (interrupted requests
  resume as prompt + tokens so far, so each position keeps the routing of the chunk that
  generated its token);
- ``routing_row``: one trajectory's ``routed_experts`` ``[1, L, n_moe_layers, top_k]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["routing_row", "splice_routing"]


def splice_routing(
    before: torch.Tensor | None, chunk: Any, chunk_input_len: int, rid: str
) -> torch.Tensor:
    """Expert ids per token after one more chunk of a request: the rows of ``before`` that
    generated the tokens so far (the first ``chunk_input_len - 1``: the token at position i
    is produced by the forward at i - 1), then ``chunk``'s rows from there on (its tokens
    were generated with its own weights). ``chunk``: ``[chunk_input_len + new - 1,
    n_moe_layers, top_k]`` (or flat ``[rows, n_moe_layers * top_k]``) from the server."""
    if chunk is None:
        raise RuntimeError(
            f"request {rid}: return_routed_experts is set but the server returned no routed "
            "experts (a dense model routes nothing; serve a mixture-of-experts model)"
        )
    rows = torch.as_tensor(np.asarray(chunk), dtype=torch.int32)
    if before is None or chunk_input_len <= 1:
        return rows
    keep = chunk_input_len - 1
    return torch.cat([before[:keep], rows[keep:]], dim=0)


def routing_row(routed: torch.Tensor, n: int) -> torch.Tensor:
    """``[1, n, n_moe_layers, top_k]`` int32 from the server's ``[n - 1 or n, ...]`` rows
    (flat ``[rows, n_moe_layers * top_k]`` rows keep their one trailing dimension)."""
    routed = torch.as_tensor(routed, dtype=torch.int32)
    if routed.shape[0] not in (n - 1, n):
        raise ValueError(f"routed_experts has {routed.shape[0]} rows for a sequence of {n} tokens")
    if routed.shape[0] == n - 1:
        routed = torch.cat([routed, routed.new_zeros((1, *routed.shape[1:]))], dim=0)
    return routed.unsqueeze(0)
