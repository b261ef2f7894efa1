"""``RoutingRecorder``: the experts a mixture-of-experts model routed each token to, for
requests that ask ``return_routed_experts`` (routing replay in the trainer).

Forward hooks on the routers of a transformers MoE model (modules with ``top_k`` and
``num_experts`` whose forward returns ``(logits, weights, expert ids)``, as
Qwen3-MoE's ``mlp.gate``) keep the last forward's expert ids; ``take`` returns them as
``[rows, n_moe_layers, top_k]`` and forgets them. The core reads them after each prefill
(one row per prompt position) and each decode step (one row per running request: the
token fed at that step, i.e. the previous output token).
"""

from __future__ import annotations

import torch

__all__ = ["RoutingRecorder"]


class RoutingRecorder:
    """Hooks on every router of ``model`` (see ``attach``)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self._last: list[torch.Tensor | None] = [None] * len(routers)
        for i, m in enumerate(routers):
            m.register_forward_hook(self._hook(i))

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RoutingRecorder | None:
        """A recorder on ``model``'s routers, or None for a dense model."""
        routers = [
            m
            for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")
        ]
        return cls(routers) if routers else None

    @property
    def n_layers(self) -> int:
        return len(self._last)

    def _hook(self, i: int):
        def hook(_module, _inputs, out):
            self._last[i] = out[2].detach()

        return hook

    def take(self) -> torch.Tensor:
        """``[rows, n_moe_layers, top_k]`` expert ids (int16) of the last forward."""
        if any(t is None for t in self._last):
            raise RuntimeError("RoutingRecorder.take: no forward recorded since the last take")
        out = torch.stack(self._last, dim=1).to(torch.int16)
        self._last = [None] * len(self._last)
        return out
