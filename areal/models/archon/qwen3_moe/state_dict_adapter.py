"""``Qwen3MoeStateDictAdapter``: HuggingFace Qwen3MoeForCausalLM names <-> the engine's.

Attention, norms, embeddings, head and dense (mlp_only) layers use the qwen2/qwen3 map.
The experts: a checkpoint on disk holds one tensor per expert
(``mlp.experts.{j}.{gate,up,down}_proj.weight``), transformers' in-memory model the
fused ``mlp.experts.gate_up_proj`` [E, 2I, D] and ``mlp.experts.down_proj`` [E, D, I];
``from_hf`` reads either, ``to_hf`` writes the per-expert form (``fused=True``: the
in-memory one). The engine holds ``layers.{i}.moe.experts.{w1,w3}`` [E, I, D] (gate, up),
``w2`` [E, D, I] and the router ``layers.{i}.moe.router.gate.weight`` [E, D].
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor

from areal.models.archon.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = ["Qwen3MoeStateDictAdapter"]

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
)
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER_HF = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w1|w2|w3)$")
_ROUTER = re.compile(r"^layers\.(\d+)\.moe\.router\.gate\.weight$")
_W = {"gate": "w1", "down": "w2", "up": "w3"}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    """The qwen3 map plus the experts and routers (module docstring)."""

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rest: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        per: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for k, v in hf_state.items():
            if m := _PER_EXPERT.match(k):
                per.setdefault((m.group(1), _W[m.group(3)]), {})[int(m.group(2))] = v
            elif m := _FUSED.match(k):
                pre = f"layers.{m.group(1)}.moe.experts."
                if m.group(2) == "down_proj":
                    out[pre + "w2"] = v
                else:
                    gate, up = v.chunk(2, dim=1)
                    out[pre + "w1"], out[pre + "w3"] = gate, up
            elif m := _ROUTER_HF.match(k):
                out[f"layers.{m.group(1)}.moe.router.gate.weight"] = v
            else:
                rest[k] = v
        for (layer, w), experts in per.items():
            if sorted(experts) != list(range(self.args.n_experts)):
                raise KeyError(
                    f"layer {layer} {w}: experts {sorted(experts)} in the checkpoint, "
                    f"expected 0..{self.args.n_experts - 1}"
                )
            out[f"layers.{layer}.moe.experts.{w}"] = torch.stack(
                [experts[j] for j in range(self.args.n_experts)]
            )
        out.update(super().from_hf(rest))
        return out

    def to_hf(self, state: dict[str, torch.Tensor], fused: bool = False) -> dict[str, torch.Tensor]:
        rest: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in state.items():
            if m := _EXPERTS.match(k):
                experts.setdefault(m.group(1), {})[m.group(2)] = _full(v)
            elif m := _ROUTER.match(k):
                out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = v
            else:
                rest[k] = v
        inv = {w: name for name, w in _W.items()}
        for layer, ws in experts.items():
            pre = f"model.layers.{layer}.mlp.experts."
            if fused:
                out[pre + "gate_up_proj"] = torch.cat([ws["w1"], ws["w3"]], dim=1)
                out[pre + "down_proj"] = ws["w2"]
                continue
            for w, t in ws.items():
                for j in range(t.shape[0]):
                    out[f"{pre}{j}.{inv[w]}_proj.weight"] = t[j]
        out.update(super().to_hf(rest))
        return out
