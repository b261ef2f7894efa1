"""The tensor dict every workflow returns for one trajectory (``[1, L]`` rows).

``trajectory_tensors(...)`` pads one sequence into the layout of
``areal.api.engine_api`` (per-token values at the position of the token they score);
``single_turn_trajectory(...)`` builds it from a prompt and one ``ModelResponse``.

Mixture-of-experts rollouts with ``rollout.return_routed_experts`` add ``routed_experts``
``[1, L, n_moe_layers, top_k]`` (int32): row i holds the experts the inference server
routed position i to (the forward that produced token i + 1; the last row, which
produced nothing, is 0). The Archon engine replays them with ``archon.router_replay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from areal.utils.batch import pad_sequences_to_tensors
from areal.utils.moe_routing import routing_row

if TYPE_CHECKING:
    from areal.api.io_struct import ModelResponse

TRAJECTORY_DTYPES = dict(
    input_ids=torch.long,
    attention_mask=torch.bool,
    loss_mask=torch.long,
    logprobs=torch.float32,
    versions=torch.long,
    rewards=torch.float32,
    seqlen=torch.long,
    no_eos=torch.bool,
)


def trajectory_tensors(
    input_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float],
    versions: list[int],
    reward: float,
    no_eos: bool,
    routed_experts: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One trajectory as padded tensors: the per-token lists must have equal lengths;
    ``routed_experts`` ``[L - 1 or L, n_moe_layers, top_k]`` when the rollout has them."""
    n = len(input_ids)
    if not len(loss_mask) == len(logprobs) == len(versions) == n:
        raise ValueError(
            f"trajectory lists differ in length: input_ids {n}, loss_mask {len(loss_mask)}, "
            f"logprobs {len(logprobs)}, versions {len(versions)}"
        )
    seq = dict(
        input_ids=input_ids,
        attention_mask=[True] * n,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        rewards=float(reward),
        seqlen=n,
        no_eos=bool(no_eos),
    )
    out = pad_sequences_to_tensors([seq], dtypes=TRAJECTORY_DTYPES)
    if routed_experts is not None:
        out["routed_experts"] = routing_row(routed_experts, n)
    return out


def single_turn_trajectory(
    input_ids: list[int], resp: ModelResponse, reward: float, owner: str = "workflow"
) -> dict[str, torch.Tensor]:
    """Prompt (not trained, version -1) + the generated tokens with their logprobs/versions."""
    p_len, c_len = len(input_ids), resp.output_len
    if len(resp.output_logprobs) != c_len or len(resp.output_versions) != c_len:
        raise ValueError(
            f"{owner}: response {resp.metadata.get('rid', '')} has {c_len} tokens but "
            f"{len(resp.output_logprobs)} logprobs and {len(resp.output_versions)} versions"
        )
    return trajectory_tensors(
        input_ids=list(input_ids) + list(resp.output_tokens),
        loss_mask=[0] * p_len + [1] * c_len,
        logprobs=[0.0] * p_len + [float(x) for x in resp.output_logprobs],
        versions=[-1] * p_len + [int(v) for v in resp.output_versions],
        reward=reward,
        no_eos=resp.stop_reason == "length",
        routed_experts=resp.routed_experts,
    )
