"""The trainer side shared by the weight-sync tests (``test_weight_sync.py``,
``test_weight_sync_refusal.py``): a ``LocalScheduler``, a ``TrainController`` with one
``FSDPEngine`` worker on the tiny model, and the SFT step that moves its weights away from
what the servers loaded.

``actor_stack`` puts ``tests/`` on ``PYTHONPATH`` first (the workers unpickle the loss
functions of ``_rpc_engines``), then starts the scheduler and the controller; on exit it
destroys the controller, closes the scheduler and restores ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from _train_config import tiny_train_config

from areal.api.io_struct import FinetuneSpec

PROMPT = [11, 52, 7, 300, 41]


@contextlib.contextmanager
def tests_on_pythonpath() -> Iterator[None]:
    """``tests/`` first on ``PYTHONPATH`` (inherited by the worker processes) while inside."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    old_pp = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, old_pp]))
    try:
        yield
    finally:
        if old_pp is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pp


@contextlib.contextmanager
def actor_stack(root: str, model_dir: str, experiment_name: str, timeout: float) -> Iterator:
    """An initialized ``TrainController`` (role ``actor``, one FSDPEngine worker on
    ``model_dir``, lr 1e-2) under a ``LocalScheduler`` at ``root``; ``timeout``: the
    scheduler's start-up and call timeouts."""
    from areal.infra.controller.train_controller import TrainController
    from areal.infra.scheduler.local import LocalScheduler

    config = tiny_train_config(
        model_dir, experiment_name, lr=1e-2, weight_decay=0.0, warmup_steps_proportion=0.0
    )
    with tests_on_pythonpath():
        sched = LocalScheduler(fileroot=root, startup_timeout=timeout, call_timeout=timeout)
        actor = TrainController("areal.engine.fsdp_engine.FSDPEngine", config, sched)
        try:
            actor.initialize(
                "actor",
                world_size=1,
                ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1),
            )
            yield actor
        finally:
            actor.destroy()
            sched.close()


def train_step(actor) -> None:
    """One SFT step: the actor's weights move away from what the servers hold."""
    from _rpc_engines import sft_loss_fn, sft_loss_weight_fn

    ids = torch.tensor([PROMPT + [9, 10, 12, 13]] * 2)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    actor.train_batch(batch, sft_loss_fn, sft_loss_weight_fn)
