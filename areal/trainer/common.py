"""Set-up shared by the trainers: seeding, log directory, tokenizer, dataloader, scheduler;
and the step loop of the supervised trainers (SFT, RW, DPO)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal.api.cli_args import get_log_path, save_config
from areal.api.io_struct import FinetuneSpec, StepInfo
from areal.utils import perf_tracer
from areal.utils.evaluator import Evaluator
from areal.utils.recover import RecoverHandler
from areal.utils.saver import Saver
from areal.utils.seeding import set_random_seed
from areal.utils.stats_logger import StatsLogger


@dataclass
class RunSetup:
    log_dir: str
    tokenizer: Any
    train_dataloader: Any
    ft_spec: FinetuneSpec


def setup_run(config: Any, train_dataset: Any, model_path: str) -> RunSetup:
    """Resolve hub ids, seed everything, create the log dir (with ``config.yaml``),
    tokenizer, dataloader, FinetuneSpec."""
    from areal.utils.dataloader import create_dataloader
    from areal.utils.hf_utils import load_hf_tokenizer, resolve_config_hub_paths

    # Hub ids (actor.path: Qwen/...) -> local snapshots, once, before any worker starts.
    resolve_config_hub_paths(config)
    set_random_seed(config.seed)
    log_dir = get_log_path(config)
    os.makedirs(log_dir, exist_ok=True)
    save_config(config, log_dir)
    configure_perf_tracer(config, log_dir)
    tokenizer = load_hf_tokenizer(config.tokenizer_path or model_path)
    bs = config.train_dataset.batch_size
    if len(train_dataset) < bs:
        raise ValueError(
            f"train_dataset has {len(train_dataset)} rows, fewer than train_dataset.batch_size={bs}"
        )
    dataloader = create_dataloader(train_dataset, config.train_dataset, seed=config.seed)
    ft_spec = FinetuneSpec(
        total_train_epochs=config.total_train_epochs,
        dataset_size=len(dataloader) * bs,
        train_batch_size=bs,
        total_train_steps_override=config.total_train_steps,
    )
    return RunSetup(log_dir, tokenizer, dataloader, ft_spec)


def configure_perf_tracer(config: Any, log_dir: str) -> None:
    """Turn the perf tracer on when ``config.perf_tracer.enabled``: this process (the
    controller, rank 0) appends its spans to ``{log_dir}/perf_tracer/traces-r0.jsonl``."""
    tracer_config = config.perf_tracer
    if tracer_config is None or not tracer_config.enabled:
        return
    perf_tracer.configure(tracer_config, rank=0, save_dir=os.path.join(log_dir, "perf_tracer"))


def flush_perf_tracer(config: Any, global_step: int) -> None:
    """Flush the trace every ``perf_tracer.save_interval`` steps (a no-op when off)."""
    tracer_config = config.perf_tracer
    if tracer_config is not None and (global_step + 1) % tracer_config.save_interval == 0:
        perf_tracer.flush()


def attach_services(trainer: Any, config: Any, ft_spec: FinetuneSpec) -> None:
    """Give ``trainer`` its ``saver``, ``evaluator``, ``stats_logger`` and
    ``recover_handler``, configured from ``config`` (the step loop uses all four)."""
    trainer.saver = Saver(config.saver, ft_spec)
    trainer.evaluator = Evaluator(config.evaluator, ft_spec)
    trainer.stats_logger = StatsLogger(config.stats_logger, ft_spec)
    trainer.recover_handler = RecoverHandler(config.recover, ft_spec)


def make_scheduler(config: Any):
    """Scheduler chosen by ``scheduler.type`` (None = local)."""
    stype = config.scheduler.type or "local"
    if stype == "local":
        from areal.infra.scheduler.local import LocalScheduler

        return LocalScheduler(
            fileroot=config.cluster.fileroot,
            experiment_name=config.experiment_name,
            trial_name=config.trial_name,
        )
    if stype == "ray":
        from areal.infra.scheduler.ray import RayScheduler

        return RayScheduler(config)
    if stype == "slurm":
        from areal.infra.scheduler.slurm import SlurmScheduler

        return SlurmScheduler(config)
    raise ValueError(f"scheduler.type={stype!r}; allowed: 'local', 'ray', 'slurm'")


def teardown_run(trainer: Any, components: tuple[str, ...]) -> None:
    """Destroy ``trainer``'s controllers named in ``components`` (in that order), delete
    every worker of its scheduler and close its stats logger.

    Each part is torn down even when an earlier one fails (the failure is logged), so a
    crashed run leaves no worker behind.
    """
    from areal.utils import logging

    logger = logging.getLogger("Trainer")
    handler = getattr(trainer, "recover_handler", None)
    if handler is not None:
        try:  # before the engines go: shutdown waits for a background checkpoint write
            handler.close()
        except Exception as e:  # the previous complete checkpoint stays the valid one
            logger.error(f"the background recover checkpoint write failed: {e}")
    for name in components:
        comp = getattr(trainer, name, None)
        if comp is None:
            continue
        try:
            comp.destroy()
        except Exception as e:  # keep tearing the rest down
            logger.warning(f"destroy {name} failed: {e}")
    sched = getattr(trainer, "scheduler", None)
    if sched is not None:
        try:
            sched.delete_workers(None)
        except Exception as e:
            logger.warning(f"deleting workers failed: {e}")
    perf_tracer.flush()  # spans since the last periodic flush (no-op when off)
    sl = getattr(trainer, "stats_logger", None)
    if sl is not None:
        png = sl.close()
        if png:
            logger.info(f"Curves written to {png}")
    for name in ("train_dataloader", "valid_dataloader"):
        try:
            stop_dataloader_workers(getattr(trainer, name, None))
        except Exception as e:
            logger.warning(f"stopping the {name} workers failed: {e}")


def stop_dataloader_workers(dataloader: Any) -> None:
    """Stop the worker processes (``num_workers > 0``) of ``dataloader``'s live iterator.

    A ``StatefulDataLoader`` keeps its last iterator (for ``state_dict``), so its workers
    outlive the run; left to garbage collection they are joined whenever it finds them,
    taking seconds per worker (measured: 4 workers ~20 s at collection, 2.7 s here).
    torch's shutdown joins each worker for a few seconds and then only sends SIGTERM to
    one still running (on a loaded machine it can be still alive when that returns), so
    each worker is then joined, and killed if it has not exited within
    ``WORKER_EXIT_TIMEOUT_S``: when this returns, none is alive.
    """
    it = getattr(dataloader, "_iterator", None)
    workers = list(getattr(it, "_workers", None) or [])
    if not workers:
        return
    it._shutdown_workers()
    for w in workers:
        w.join(WORKER_EXIT_TIMEOUT_S)
        if w.is_alive():
            from areal.utils import logging

            logging.getLogger("Trainer").warning(
                f"dataloader worker pid {w.pid} did not exit: killed"
            )
            w.kill()
            w.join(WORKER_EXIT_TIMEOUT_S)


WORKER_EXIT_TIMEOUT_S = 30.0


def run_step_loop(
    trainer: Any,
    engine: Any,
    train_step: Callable[[Any], tuple[float, dict[str, float]]],
    evaluate: Callable[[], Any],
    eval_stats: Callable[[int, Any], dict[str, float]],
    log: Any,
    prefix: str = "",
) -> list[float]:
    """The step loop of the supervised trainers (SFT, RW, DPO); returns the step losses.

    Resumes after the recover checkpoint, cycles ``trainer.train_dataloader`` and, for each
    remaining step: ``train_step(rows) -> (loss, stats)`` (timed as ``time/train_step``);
    the evaluator on ``evaluate`` (a result becomes stats by ``eval_stats(global_step,
    result)``); the saver; the recover dump; then commits ``{prefix + key: value}`` and logs
    the loss every 10 steps on ``log``. ``trainer`` holds ``ft_spec``,
    ``train_dataloader``, ``tokenizer``, ``saver``, ``evaluator``, ``stats_logger`` and
    ``recover_handler``; ``engine`` is the trained model's controller.
    """
    total, spe = trainer.ft_spec.total_train_steps, trainer.ft_spec.steps_per_epoch
    loader = trainer.train_dataloader
    services = (trainer.saver, trainer.evaluator, trainer.stats_logger)
    info = trainer.recover_handler.load(engine, *services, loader)
    start = 0 if info is None else info.last_step_info.next().global_step
    losses: list[float] = []
    data_iter = iter(loader)
    for global_step in range(start, total):
        epoch, step = divmod(global_step, spe)
        try:
            rows = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            rows = next(data_iter)
        t0 = time.monotonic()
        with perf_tracer.trace_scope("trainer.train_step", perf_tracer.Category.COMPUTE):
            loss, stats = train_step(rows)
        stats["time/train_step"] = time.monotonic() - t0
        losses.append(loss)
        ev = trainer.evaluator.evaluate(evaluate, epoch, step, global_step)
        if ev is not None:
            stats.update(eval_stats(global_step, ev))
        trainer.saver.save(engine, epoch, step, global_step, tokenizer=trainer.tokenizer)
        with perf_tracer.trace_scope("trainer.checkpoint_for_recover", perf_tracer.Category.IO):
            trainer.recover_handler.dump(
                engine, StepInfo(epoch, step, global_step, spe), *services, loader
            )
        flush_perf_tracer(trainer.config, global_step)
        trainer.stats_logger.commit(
            epoch, step, global_step, {f"{prefix}{k}": v for k, v in stats.items()}
        )
        if global_step % 10 == 0:
            log.info(f"step {global_step}/{total} loss {losses[-1]:.4f}")
    return losses
