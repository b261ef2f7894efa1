"""The training half of one PPO step, on the roles' workers (``PPOTrainer._train_step``).

In order (``held=True``, the default: each role's workers receive the batch once):

1. ``actor.put_batch(batch)``: the actor's workers receive their shards (the one crossing);
2. proximal logprobs on the actor, kept there (``_store_as="prox_logp"``);
3. ``ref`` / ``teacher``: each role's workers receive the batch once and send back one
   ``[B, T]`` tensor (``ref_logp`` / ``teacher_logp``); ``critic``: its workers hold the
   batch too (``put_batch``) and the values come back; the actor gets these tensors
   (``BatchRef.update``), not the batch again;
4. the consistency statistics, reduced on the actor's workers (three numbers per rank);
5. ``compute_advantages`` in place on the actor's workers (a user's wrapper that returns a
   plain dict, computed on a copy it read, has that dict written back to the workers);
6. ``ppo_update`` (only its stats come back) and the LR step; the critic gets the
   actor's ``returns`` and updates on the batch it holds;
7. every held batch is freed, also when a step fails.

``held=False`` is the earlier path, kept for comparison (``benchmarks/bench_batch_transfer.py``):
the batch is sliced and shipped in every call and merged back after
``compute_advantages``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from areal.trainer.ppo.stats import (
    combine_consistency,
    consistency_partials,
    consistency_stats,
    flatten_stats,
)
from areal.utils import logging

logger = logging.getLogger("PPOStep")


@dataclass
class PPORoles:
    """The ``TrainController`` of each role of a PPO run (``None``: role not used)."""

    actor: Any
    ref: Any = None
    teacher: Any = None
    critic: Any = None


def teacher_inputs(teacher: Any, batch: dict[str, Any], config: Any) -> dict[str, torch.Tensor]:
    """``teacher_logp`` of every trajectory and the loss weights (as AReaL, per row)."""
    bs = batch["attention_mask"].shape[0]
    return {
        "teacher_logp": teacher.compute_logp(batch),
        "rl_loss_weight": torch.full((bs,), float(config.rl_loss_weight)),
        "distill_loss_weight": torch.full((bs,), float(config.distill_loss_weight)),
    }


def train_on_batch(
    roles: PPORoles,
    batch: dict[str, Any],
    config: Any,
    version: int,
    timed: Callable[[str], AbstractContextManager],
    *,
    held: bool = True,
) -> dict[str, float]:
    """Steps 1-7 of the module doc; returns the train and consistency stats.

    ``config``: the ``PPOConfig`` (``actor.should_compute_prox_logp()``, ``teacher``);
    ``timed(name)``: a context manager timing ``compute_logp``, ``compute_advantages``
    and ``train_step``."""
    run = _held_step if held else _shipped_step
    return run(roles, batch, config, version, timed)


def _held_step(roles, batch, config, version, timed) -> dict[str, float]:
    stats: dict[str, float] = {}
    actor_ref = critic_ref = None
    try:
        with timed("compute_logp"):
            actor_ref = roles.actor.put_batch(batch)
            prox = config.actor.should_compute_prox_logp()
            if prox:
                roles.actor.compute_logp(actor_ref, _store_as="prox_logp")
            extra: dict[str, Any] = {}
            if roles.ref is not None:
                extra["ref_logp"] = roles.ref.compute_logp(batch)
            if roles.teacher is not None:
                extra.update(teacher_inputs(roles.teacher, batch, config.teacher))
            if roles.critic is not None:
                critic_ref = roles.critic.put_batch(batch)
                roles.critic.compute_values(critic_ref, _store_as="values")
                extra.update(critic_ref.fetch(["values"]))
            if extra:
                actor_ref.update(extra)
        if prox:
            stats.update(combine_consistency(actor_ref.apply(consistency_partials, version)))
        with timed("compute_advantages"):
            out = roles.actor.compute_advantages(actor_ref)
            if isinstance(out, dict):
                # a wrapper of compute_advantages (e.g. a reward control) ran it on a plain
                # copy of the batch it read from the workers: that result is the batch now
                actor_ref.update(out)
        with timed("train_step"):
            train_stats = flatten_stats(roles.actor.ppo_update(actor_ref))
            roles.actor.step_lr_scheduler()
            if roles.critic is not None:
                critic_ref.update(actor_ref.fetch(["returns"]))
                critic_stats = roles.critic.ppo_update(critic_ref)
                roles.critic.step_lr_scheduler()
                train_stats.update(
                    {f"critic/{k}": v for k, v in flatten_stats(critic_stats).items()}
                )
    except BaseException:
        _free_quietly(actor_ref, critic_ref)  # the step's own error is the one to see
        raise
    for ref in (actor_ref, critic_ref):
        if ref is not None:
            ref.free()
    stats.update(train_stats)
    return stats


def _free_quietly(*refs: Any) -> None:
    for ref in refs:
        if ref is None:
            continue
        try:
            ref.free()
        except Exception as e:  # noqa: BLE001 - e.g. the worker that failed the step is dead
            logger.warning(f"freeing {ref!r} after a failed step: {e}")


def _shipped_step(roles, batch, config, version, timed) -> dict[str, float]:
    stats: dict[str, float] = {}
    batch = dict(batch)
    with timed("compute_logp"):
        # prox_logp_method='loglinear': no proximal forward pass (approximated in the loss)
        if config.actor.should_compute_prox_logp():
            batch["prox_logp"] = roles.actor.compute_logp(batch)
        if roles.ref is not None:
            batch["ref_logp"] = roles.ref.compute_logp(batch)
        if roles.teacher is not None:
            batch.update(teacher_inputs(roles.teacher, batch, config.teacher))
        if roles.critic is not None:
            batch["values"] = roles.critic.compute_values(batch)
    if "prox_logp" in batch:
        stats.update(consistency_stats(batch, version))
    with timed("compute_advantages"):
        batch = roles.actor.compute_advantages(batch)
    with timed("train_step"):
        train_stats = flatten_stats(roles.actor.ppo_update(batch))
        roles.actor.step_lr_scheduler()
        if roles.critic is not None:
            critic_stats = roles.critic.ppo_update(batch)
            roles.critic.step_lr_scheduler()
            train_stats.update({f"critic/{k}": v for k, v in flatten_stats(critic_stats).items()})
    stats.update(train_stats)
    return stats
