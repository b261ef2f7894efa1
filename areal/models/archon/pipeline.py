"""Pipeline-parallel stages of a dense Archon model.

A :class:`DenseTransformer` is cut into ``n_stages`` contiguous stages (``pp`` of them, or
``pp * v`` virtual stages for the interleaved schedule, stage ``s`` on pipeline rank
``s % pp``): stage 0 owns the token embedding, the last stage owns the final norm and the
output head, and each stage owns a contiguous run of decoder blocks (:func:`plan_stages`).
Stages exchange fixed-shape activations (one packed micro-batch padded to a common length,
``[1, L, dim]``), which is what ``torch.distributed.pipelining`` needs; the positions and
sequence boundaries of each micro-batch are not sent between stages, every stage reads
them from :attr:`DenseStage.mb_meta` (the engine gives every pipeline rank the same
micro-batches).

Mixture-of-experts models (:class:`MoEStage`): each stage replays the routing of its own
MoE layers (the micro-batch's ``routed_experts`` slice of each layer) and, when the
load-balancing loss is trained, carries its running sums (expert assignment counts,
router probability sums, routed rows over the real tokens of the micro-batch) to the
next stage in ``ceil((2E + 1) / dim)`` extra rows of the activation; the last stage
turns them into the loss of the whole model (:func:`areal.models.archon.moe.
load_balancing_loss`, the same sums in the same layer order) and keeps it for the
micro-batch's loss (:meth:`MoEStage.pop_aux`). The router-probability sums are sent
with their gradients, so every stage's routers get the aux loss's gradient.

The engine side (schedules per step, loss, forward-only passes) is
``areal.engine.archon.pipeline_engine``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from areal.models.archon.base import DenseTransformer
from areal.models.archon.layers import rope_cos_sin
from areal.models.archon.moe import MoE

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def stage_layer_ranges(
    n_layers: int, n_stages: int, first_less: int = 0, last_less: int = 0
) -> list[range]:
    """Contiguous layer ranges per stage.

    The embedding counts as ``first_less`` layers and the output head as ``last_less``
    (AReaL's ``pp_first_stage_less_layers`` / ``pp_last_stage_less_layers``): the
    ``n_layers + first_less + last_less`` units are spread evenly, earlier stages taking
    the remainder, and the first and last stage get that many fewer decoder blocks. A
    middle stage gets at least one block; the first and last may get none (they still
    hold the embedding / the head)."""
    if n_stages < 1 or first_less < 0 or last_less < 0:
        raise ValueError(
            f"n_stages={n_stages}, first_less={first_less}, last_less={last_less}: "
            "need n_stages >= 1 and non-negative first/last stage reductions"
        )
    units = n_layers + (first_less + last_less if n_stages > 1 else 0)
    base, extra = divmod(units, n_stages)
    counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    if n_stages > 1:
        counts[0] -= first_less
        counts[-1] -= last_less
    bad = [
        s
        for s, c in enumerate(counts)
        if c < 0 or (c == 0 and 0 < s < n_stages - 1) or (c == 0 and n_stages == 1)
        or (c == 0 and s == 0 and first_less == 0) or (c == 0 and s == n_stages - 1 and last_less == 0)
    ]  # fmt: skip
    if bad or sum(counts) != n_layers:
        raise ValueError(
            f"pp stages={n_stages}: {n_layers} decoder layers cannot be split into "
            f"{n_stages} stages with first_stage_less_layers={first_less} and "
            f"last_stage_less_layers={last_less} (layers per stage would be {counts}); "
            f"allowed: at most {n_layers} stages, fewer virtual stages or smaller reductions"
        )
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def plan_stages(
    n_layers: int,
    pp: int,
    schedule: str,
    layers_per_stage: int | None = None,
    first_less: int = 1,
    last_less: int = 1,
) -> list[range]:
    """The stages of a ``pp``-rank pipeline: one per rank for 'GPipe'/'1F1B'; for
    'Interleaved1F1B' ``pp * v`` virtual stages, ``v = 2`` unless ``layers_per_stage``
    fixes the count (``(n_layers + first_less + last_less) / layers_per_stage`` stages,
    which must be a multiple of ``pp``). Errors name the ``archon.pp_*`` fields."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"archon.pp_schedule={schedule!r}: not supported by the pipeline stages; "
            f"allowed: {list(SCHEDULES)}"
        )
    multi = schedule == "Interleaved1F1B"
    if layers_per_stage is None:
        n_stages = pp * (2 if multi else 1)
    else:
        units = n_layers + first_less + last_less
        if layers_per_stage < 1 or units % layers_per_stage:
            raise ValueError(
                f"archon.pp_layers_per_stage={layers_per_stage}: must divide n_layers + "
                f"pp_first_stage_less_layers + pp_last_stage_less_layers = {units}"
            )
        n_stages = units // layers_per_stage
        if n_stages % pp or (not multi and n_stages != pp):
            raise ValueError(
                f"archon.pp_layers_per_stage={layers_per_stage} gives {n_stages} stages; "
                f"archon.pp_schedule={schedule!r} with p{pp} needs "
                + ("a multiple of pp" if multi else f"exactly {pp} (one per rank)")
            )
    return stage_layer_ranges(n_layers, n_stages, first_less, last_less)


class DenseStage(nn.Module):
    """One pipeline stage of a dense model: keeps only the modules the stage owns.

    ``forward`` takes ``[1, L]`` token ids on the first stage and ``[1, L, dim]`` hidden
    states elsewhere; returns ``[1, L, dim]`` or, on the last stage, ``[1, L, vocab]``."""

    def __init__(self, model: DenseTransformer, stage: int, pp: int, layers: range | None = None):
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
        owned = stage_layer_ranges(args.n_layers, pp)[stage] if layers is None else layers
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in owned})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        # packed micro-batches: (positions [L], cu_seqlens[, ...]) of micro-batch i, read
        # in forward order (every schedule runs a stage's forwards in micro-batch order)
        self.mb_meta: list[tuple] | None = None
        self._calls = 0

    def set_micro_batches(self, meta: list[tuple] | None) -> None:
        """The (positions, cu_seqlens) of the next ``len(meta)`` forwards (None: one
        sequence per micro-batch); :class:`MoEStage` reads two more entries."""
        self.mb_meta, self._calls = meta, 0

    def act_rows(self, length: int) -> int:
        """Rows of the activation this stage sends for an ``length``-token micro-batch."""
        return length

    def _next_meta(self, n: int, device) -> tuple[int, tuple]:
        """(micro-batch index, its meta) of this forward."""
        if self.mb_meta:
            i = self._calls % len(self.mb_meta)
            self._calls += 1
            return i, self.mb_meta[i]
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        return 0, (torch.arange(n, device=device), cu)

    def _blocks(self, h: torch.Tensor, meta: tuple) -> torch.Tensor:
        positions, cu = meta[0], meta[1]
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, h.dtype)
        for block in self.layers.values():
            h = block(h, cos, sin, cu)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x[0]) if self.is_first else x[0]
        _, meta = self._next_meta(h.shape[0], h.device)
        h = self._blocks(h, meta)
        if self.is_last:
            h = self.output(self.norm(h))
        return h[None].clone()  # not a view: FSDP's pre-backward hook sits on the output


class MoEStage(DenseStage):
    """A stage of a mixture-of-experts model (module docstring): routing replay of its MoE
    layers and, with ``carry_aux``, the load-balancing loss's running sums.

    Meta of a micro-batch: ``(positions, cu_seqlens, n_real, routed)``: ``n_real`` the
    tokens the aux loss counts (the rest is padding), ``routed`` ``[L, n_moe_layers,
    top_k]`` expert ids to replay, or None."""

    def __init__(self, model: DenseTransformer, stage: int, pp: int, layers: range | None = None):
        super().__init__(model, stage, pp, layers)
        sparse = [i for i in range(self.args.n_layers) if self.args.is_sparse(i)]
        # (global MoE-layer index, module) of this stage's MoE layers, in layer order
        self.moes: list[tuple[int, MoE]] = [
            (sparse.index(int(k)), m)
            for k, block in self.layers.items()
            for m in block.modules()
            if isinstance(m, MoE)
        ]
        self.n_sums = 2 * self.args.n_experts + 1  # counts [E], probability sums [E], rows
        self.carry_aux = False
        self._aux: dict[int, torch.Tensor] = {}

    def act_rows(self, length: int) -> int:
        return length + (math.ceil(self.n_sums / self.args.dim) if self.carry_aux else 0)

    def pop_aux(self, i: int) -> torch.Tensor:
        """The last stage's load-balancing loss of micro-batch ``i`` (unscaled)."""
        return self._aux.pop(i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.args.n_experts
        if self.is_first:
            h = self.tok_embeddings(x[0])
            sums = h.new_zeros(self.n_sums, dtype=torch.float32)
        elif self.carry_aux:
            length = x.shape[1] - self.act_rows(0)
            h, sums = x[0, :length], x[0, length:].reshape(-1)[: self.n_sums].float()
        else:
            h = x[0]
        i, meta = self._next_meta(h.shape[0], h.device)
        routed = meta[3] if len(meta) > 3 else None
        n_real = meta[2] if len(meta) > 2 else h.shape[0]
        for j, m in self.moes:
            m.replay = None if routed is None else routed[:, j]
        try:
            h = self._blocks(h, meta)
        finally:
            for _, m in self.moes:
                m.replay = None
        if self.carry_aux:
            for _, m in self.moes:  # as load_balancing_loss: layer by layer
                p = torch.softmax(m.last_logits[:n_real].float(), dim=-1)
                _, sel = torch.topk(p, m.top_k, dim=-1)
                counts = torch.bincount(sel.reshape(-1), minlength=e).float()
                rows = torch.full((1,), float(p.shape[0]), device=p.device)
                sums = sums + torch.cat([counts, p.sum(0), rows])
        if self.is_last:
            h = self.output(self.norm(h))
            if self.carry_aux:
                tokens, probs, rows = sums[:e].detach(), sums[e:-1], sums[-1].detach()
                self._aux[i] = (tokens / rows * probs / rows).sum() * e
            return h[None].clone()
        if self.carry_aux:
            pad = self.act_rows(0) * self.args.dim - self.n_sums
            extra = torch.nn.functional.pad(sums, (0, pad)).to(h.dtype).view(-1, self.args.dim)
            return torch.cat([h, extra])[None]
        return h[None].clone()


def make_stage(model: DenseTransformer, stage: int, pp: int, layers: range | None = None):
    """:class:`MoEStage` for a mixture-of-experts model, :class:`DenseStage` otherwise."""
    cls = MoEStage if model.args.n_experts else DenseStage
    return cls(model, stage, pp, layers)


def build_schedule(
    stage_modules: DenseStage | list[DenseStage],
    group,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1F1B",
    *,
    scale_grads: bool = True,
    shapes: tuple[int, int] | None = None,
    act_dtype: torch.dtype | None = None,
):
    """A ``torch.distributed.pipelining`` schedule over this rank's stage(s) of ``group``:
    one stage for 'GPipe'/'1F1B', several virtual stages (``rank``, ``rank + pp``, ...) of a
    ``pp * v``-stage split for 'Interleaved1F1B'.

    ``shapes=(L, out_dim)``: every micro-batch is ``[1, L]`` tokens and the last stage
    returns ``[1, L, out_dim]``; the stages are then built with static shapes (no
    metadata forward on meta tensors); ``act_dtype``: their dtype (default: the
    parameters')."""
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
    stages = [_stage(pl, m, device, group, shapes, act_dtype) for m in mods]
    kw = dict(n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if schedule == "Interleaved1F1B":
        return pl.ScheduleInterleaved1F1B(stages, **kw)
    cls = pl.ScheduleGPipe if schedule == "GPipe" else pl.Schedule1F1B
    return cls(stages[0], **kw)


def _stage(pl, m: DenseStage, device, group, shapes, act_dtype):
    if shapes is None:
        return pl.PipelineStage(m, m.stage, m.pp, device, group=group)
    length, out_dim = shapes
    dim = m.args.dim
    dt = act_dtype or next(m.parameters()).dtype
    rows = m.act_rows(length)
    if m.is_first:
        inp = torch.zeros(1, length, dtype=torch.long, device=device)
    else:
        # activations take gradients (the static shapes carry requires_grad: without it
        # no gradient is sent back between stages)
        inp = torch.zeros(1, rows, dim, dtype=dt, device=device, requires_grad=True)
    shape = (1, length, out_dim) if m.is_last else (1, rows, dim)
    out = torch.zeros(shape, dtype=dt, device=device, requires_grad=True)
    return pl.PipelineStage(m, m.stage, m.pp, device, inp, out, group=group)
