"""Per-sample GAE lambda functions (``actor.gae_lambda`` as a dotted path, AReaL 2.0).

A lambda function is called once per batch as ``fn(context, **actor.gae_lambda_kwargs)``
and returns one lambda per sequence (a float tensor ``[B]``). ``context`` holds ``[B]``
integer tensors:

* ``effective_token_lengths``: loss tokens of each sequence;
* ``turn_counts``: generated turns (maximal runs of loss tokens, or the batch's
  ``turn_ids``);
* ``timestep_lengths``: the GAE timesteps, i.e. ``effective_token_lengths`` when
  ``actor.gae_timestep_unit="token"``, ``turn_counts`` when ``"turn"``.

Built in (write ``areal.trainer.ppo.lambda_fn.<name>``): :func:`constant_gae_lambda`,
:func:`vapo_length_adaptive_gae` (VAPO) and :func:`relative_position_gae_lambda`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from areal.utils.dynamic_import import import_from_string

__all__ = [
    "constant_gae_lambda",
    "gae_lambda_context",
    "per_sample_lambda",
    "relative_position_gae_lambda",
    "resolve_gae_lambda",
    "vapo_length_adaptive_gae",
]


def gae_lambda_context(
    loss_mask: torch.Tensor, turn_ids: torch.Tensor, timestep_unit: str
) -> dict[str, torch.Tensor]:
    """The ``context`` of a lambda function (module docstring) of a ``[B, T]`` batch."""
    mask = loss_mask.bool()
    tokens = mask.sum(1)
    ids = torch.where(mask, turn_ids.long(), -1)
    prev = torch.nn.functional.pad(ids[:, :-1], (1, 0), value=-1)
    turns = (mask & (ids != prev)).sum(1)
    return {
        "effective_token_lengths": tokens,
        "turn_counts": turns,
        "timestep_lengths": tokens if timestep_unit == "token" else turns,
    }


def constant_gae_lambda(context: dict[str, torch.Tensor], *, value: float) -> torch.Tensor:
    """``value`` for every sequence."""
    return torch.full(context["timestep_lengths"].shape, float(value), dtype=torch.float32)


def vapo_length_adaptive_gae(context: dict[str, torch.Tensor], *, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive ``lambda = 1 - 1 / (alpha * L)`` (arXiv 2504.05118), ``L``
    the sequence's timesteps; clamped at 0, and 0 for an empty sequence. ``alpha > 0``."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ValueError(f"gae_lambda_kwargs.alpha={alpha!r}; must be a number > 0")
    lengths = context["timestep_lengths"]
    lam = (1.0 - 1.0 / (float(alpha) * lengths.float().clamp(min=1.0))).clamp(min=0.0)
    return torch.where(lengths > 0, lam, 0.0)


def relative_position_gae_lambda(context: dict[str, torch.Tensor], *, q: float) -> torch.Tensor:
    """``lambda = q ** (1 / (L - 1))`` for ``L >= 2`` timesteps, so that a terminal reward
    keeps the fraction ``q`` at the first timestep and 1 at the last, whatever the length
    (with discount 1); 1 for ``L = 1``, 0 for an empty sequence. ``q`` in ``(0, 1]``."""
    if isinstance(q, bool) or not isinstance(q, int | float) or not (0 < q <= 1):
        raise ValueError(f"gae_lambda_kwargs.q={q!r}; must be a number in (0, 1]")
    lengths = context["timestep_lengths"]
    steps = (lengths - 1).clamp(min=1).float()
    lam = torch.exp(math.log(float(q)) / steps)
    return torch.where(lengths > 1, lam, torch.where(lengths == 1, 1.0, 0.0))


def resolve_gae_lambda(gae_lambda: float | str) -> Callable[..., torch.Tensor] | None:
    """The lambda function a dotted path names; ``None`` for a plain number."""
    if isinstance(gae_lambda, str):
        fn: Any = import_from_string(gae_lambda)
        if not callable(fn):
            raise TypeError(f"actor.gae_lambda={gae_lambda!r} is not callable")
        return fn
    return None


def per_sample_lambda(
    fn: Callable[..., torch.Tensor],
    kwargs: dict[str, Any],
    loss_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    timestep_unit: str,
) -> torch.Tensor:
    """Call a lambda function on a batch and check its answer: ``[B]`` values in [0, 1]."""
    out = fn(gae_lambda_context(loss_mask, turn_ids, timestep_unit), **dict(kwargs))
    bs = loss_mask.shape[0]
    if not isinstance(out, torch.Tensor) or out.shape != (bs,):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"the gae_lambda function returned {shape}; expected a tensor ({bs},)")
    out = out.float()
    if not bool(((out >= 0) & (out <= 1)).all()):
        raise ValueError(f"the gae_lambda function returned values outside [0, 1]: {out.tolist()}")
    return out
