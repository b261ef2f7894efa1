"""Sharding a transformers model with FSDP2 (``apply_fsdp2``: every decoder layer, then the
root) and the LR schedule of ``FSDPEngine`` (``lr_lambda``)."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn


def lr_lambda(
    scheduler_type: str, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """LR multiplier per step for ``torch.optim.lr_scheduler.LambdaLR``.

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step
    already trains). Afterwards ``constant`` (1), ``linear`` or ``cosine`` decay from 1 to
    ``min_lr_ratio`` over the remaining ``total_steps - warmup_steps`` steps.
    """
    if scheduler_type not in ("constant", "linear", "cosine"):
        raise ValueError(
            f"lr_scheduler_type={scheduler_type!r}; allowed: 'constant', 'linear', 'cosine'"
        )
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, int(warmup_steps))
    decay_steps = max(1, total_steps - warmup_steps)

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if scheduler_type == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
        if scheduler_type == "linear":
            return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def find_decoder_layers(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """Modules sharded as separate FSDP units: instances of ``class_names`` (default: the
    model's ``_no_split_modules``, i.e. transformers' decoder-layer classes)."""
    names = set(class_names or getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        for name in ("layers", "h", "blocks"):
            for m in model.modules():
                sub = getattr(m, name, None)
                if isinstance(sub, nn.ModuleList):
                    return list(sub)
    return layers


def apply_fsdp2(
    model: nn.Module,
    mesh,
    mp_policy=None,
    offload_policy=None,
    layer_cls_names: list[str] | None = None,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root module (in place)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload_policy or OffloadPolicy(),
    )
    for layer in find_decoder_layers(model, layer_cls_names):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
