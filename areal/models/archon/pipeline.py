"""Pipeline-parallel stages of a dense Archon model (first increment, model level only).

A :class:`DenseTransformer` is cut into ``pp`` contiguous stages: stage 0 owns the token
embedding, the last stage owns the final norm and the output head, and each stage owns a
contiguous run of decoder blocks. Stages exchange fixed-shape activations (one padded
sequence per micro-batch, ``[1, L, dim]``), which is what ``torch.distributed.pipelining``
needs; the packed varlen layout is therefore not used across stage boundaries.

The engine does not route ``p`` here yet: ``archon:...p2`` is still refused in
``areal.api.alloc_mode``. This module is the tested building block for that wiring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from areal.models.archon.base import DenseTransformer
from areal.models.archon.layers import rope_cos_sin

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def stage_layer_ranges(n_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per stage, earlier stages take the remainder; every stage
    gets at least one layer."""
    if pp < 1 or pp > n_layers:
        raise ValueError(
            f"pp={pp}: must be in [1, n_layers={n_layers}] (one layer per stage at least)"
        )
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class DenseStage(nn.Module):
    """One pipeline stage of a dense model: keeps only the modules the stage owns.

    ``forward`` takes ``[1, L]`` token ids on the first stage and ``[1, L, dim]`` hidden
    states elsewhere; returns ``[1, L, dim]`` or, on the last stage, ``[1, L, vocab]``."""

    def __init__(self, model: DenseTransformer, stage: int, pp: int):
        super().__init__()
        args = model.args
        if args.tie_word_embeddings and not args.is_critic and pp > 1:
            raise ValueError(
                "pipeline parallelism (pp>1) with tie_word_embeddings=True is not supported: "
                "the embedding and the output head would live on different stages; use pp=1"
            )
        self.args = args
        self.stage, self.pp = stage, pp
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        owned = stage_layer_ranges(args.n_layers, pp)[stage]
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in owned})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x[0]) if self.is_first else x[0]
        n = h.shape[0]
        positions = torch.arange(n, device=h.device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=h.device)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, h.dtype)
        for block in self.layers.values():
            h = block(h, cos, sin, cu)
        if self.is_last:
            h = self.output(self.norm(h))
        return h[None]


def build_schedule(
    stage_modules: DenseStage | list[DenseStage],
    group,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1F1B",
):
    """A ``torch.distributed.pipelining`` schedule over this rank's stage(s) of ``group``:
    one stage for 'GPipe'/'1F1B', several virtual stages (``rank``, ``rank + pp``, ...) of a
    ``pp * v``-stage split for 'Interleaved1F1B'."""
    from torch.distributed import pipelining as pl

    if schedule not in SCHEDULES:
        raise ValueError(
            f"archon.pp_schedule={schedule!r}: not supported by the pipeline stages; "
            f"allowed: {list(SCHEDULES)}"
        )
    mods = stage_modules if isinstance(stage_modules, list) else [stage_modules]
    if schedule != "Interleaved1F1B" and len(mods) != 1:
        raise ValueError(
            f"archon.pp_schedule={schedule!r} takes one stage per rank, got {len(mods)}"
        )
    device = next(mods[0].parameters()).device
    stages = [pl.PipelineStage(m, m.stage, m.pp, device, group=group) for m in mods]
    if schedule == "Interleaved1F1B":
        return pl.ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    cls = pl.ScheduleGPipe if schedule == "GPipe" else pl.Schedule1F1B
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
