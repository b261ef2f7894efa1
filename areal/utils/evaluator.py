"""Evaluation: when to evaluate (``Evaluator``, every N epochs / steps / seconds) and the
runner of one evaluation over a valid set (``run_evaluation``).

``run_evaluation`` runs one episode per row concurrently (at most ``max_concurrent`` at a
time), counts the episodes that raised, and reduces the rewards to ``eval/accuracy``
(share of rewards > 0), ``eval/reward``, ``eval/n``, ``eval/n_failed`` and ``time/eval``.
The caller says how one row becomes an episode (``PPOTrainer``: its evaluation workflow
run against the inference servers, outside the training rollouts' staleness bound).
With a ``failure_monitor`` (``PPOTrainer``: an ``EpisodeFailureMonitor`` with the
``rollout`` limits) every finished episode is recorded in it; once it trips no further
episode starts, and the evaluation raises its error (``RolloutFailureError``), as it does
when every episode of the evaluation failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from areal.api.io_struct import FinetuneSpec
from areal.utils import logging
from areal.utils.timeutil import EpochStepTimeFreqCtl

logger = logging.getLogger("Evaluator")


def run_evaluation(
    run_episode: Callable[[Any], Awaitable[Any]],
    rows: list[Any],
    *,
    max_concurrent: int = 64,
    global_step: int = 0,
    failure_monitor: Any = None,
) -> dict[str, float]:
    """Run ``run_episode(row)`` for every row; an episode's result is a dict with a
    ``rewards`` tensor (anything else is ignored). Returns the ``eval/*`` stats.

    ``failure_monitor``: an object with ``tripped``, ``record_ok()``,
    ``record_failure(exc)``, ``raise_if_tripped()`` and ``raise_if_all_failed()`` (module
    docstring)."""
    t0 = time.monotonic()
    limit = max(1, int(max_concurrent))

    async def run_all():
        sem = asyncio.Semaphore(limit)

        async def one(item):
            async with sem:
                if failure_monitor is None:
                    return await run_episode(item)
                if failure_monitor.tripped:
                    return None
                try:
                    out = await run_episode(item)
                except Exception as e:
                    failure_monitor.record_failure(e)
                    raise
                failure_monitor.record_ok()
                return out

        return await asyncio.gather(*(one(x) for x in rows), return_exceptions=True)

    outs = asyncio.run(run_all())
    if failure_monitor is not None:
        failure_monitor.raise_if_tripped()
        failure_monitor.raise_if_all_failed()
    rewards = [o["rewards"].float().reshape(-1) for o in outs if isinstance(o, dict)]
    n_failed = sum(isinstance(o, BaseException) for o in outs)
    if n_failed:
        first = next(o for o in outs if isinstance(o, BaseException))
        logger.warning(f"{n_failed}/{len(outs)} evaluation episodes failed (first: {first!r})")
    r = torch.cat(rewards) if rewards else torch.zeros(0)
    res = {
        "eval/accuracy": float((r > 0).float().mean()) if r.numel() else float("nan"),
        "eval/reward": float(r.mean()) if r.numel() else float("nan"),
        "eval/n": float(r.numel()),
        "eval/n_failed": float(n_failed),
        "time/eval": time.monotonic() - t0,
    }
    logger.info(
        f"Eval at step {global_step}: accuracy {res['eval/accuracy']:.3f} over "
        f"{int(res['eval/n'])} samples ({res['time/eval']:.1f}s)"
    )
    return res


class Evaluator:
    def __init__(self, config: Any, ft_spec: FinetuneSpec):
        self.config = config
        self.ft_spec = ft_spec
        self.freq_ctl = EpochStepTimeFreqCtl(
            freq_epoch=config.freq_epochs, freq_step=config.freq_steps, freq_sec=config.freq_secs
        )

    def evaluate(
        self, evaluate_fn: Callable[[], Any], epoch: int, step: int, global_step: int
    ) -> Any:
        """Call ``evaluate_fn()`` when due; returns its result or ``None``."""
        epoch_done = int(step + 1 == self.ft_spec.steps_per_epoch)
        if not self.freq_ctl.check(epochs=epoch_done, steps=1):
            return None
        return evaluate_fn()

    def state_dict(self) -> dict:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.freq_ctl.load_state_dict(state)
