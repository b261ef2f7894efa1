"""One ``PPOTrainer.train`` call, in named pieces that ``PPOTrainer.train`` runs in order.

1. :func:`plan_run`: the call's inputs resolved once: the workflows (agents wrapped so
   that they run through the proxy), the group filter (``dynamic_filter_fn``, its old
   name ``should_accept_fn``, or ``actor.dynamic_sampling``'s all-equal filter) and the
   step budget (``total_train_steps``, ``total_epochs``);
2. :func:`resume`: the recover checkpoint, if there is one: the run continues at the
   step after it;
3. :func:`evaluate_before`: the held-out score before the first update, logged at step
   -1 (``evaluator.eval_before_train``, a fresh run only);
4. :func:`run_steps`: the step loop. Each step is ``PPOTrainer._train_step`` (the steps
   1-4 of ``rl_trainer``'s docstring), the run-health verdict (a rollback goes on from
   the restored step, a stop ends the run), the recover checkpoint, ``rollout.resume()``
   and :func:`after_step` (evaluation when due, save, the step's log line). The loop ends
   at the budget, on SIGTERM/SIGINT (the recover checkpoint of the last completed step is
   written) or after ``max_seconds`` of training;
5. :func:`finish`: weight-sync hooks flushed, a stop signal turned into exit 128 + signal,
   the final evaluation (the last step's when it evaluated), the summary dict.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from areal.api.io_struct import StepInfo
from areal.infra.rollout.rollout_results import WaitInterrupted
from areal.trainer.common import flush_perf_tracer
from areal.utils import logging, perf_tracer, stats_tracker
from areal.utils.recover import RecoverInfo

logger = logging.getLogger("PPOTrainer")

ALL_EQUAL_FILTER = "areal.utils.dynamic_sampling.dynamic_sampling_accept"


@dataclasses.dataclass
class RunPlan:
    """What one ``train()`` call runs (:func:`plan_run`)."""

    workflow: Any
    workflow_kwargs: dict[str, Any] | None
    eval_workflow: Any
    eval_workflow_kwargs: dict[str, Any] | None
    dynamic_filter_fn: Any
    total_steps: int
    steps_per_epoch: int
    evaluates: bool  # a validation set and an evaluation workflow were given

    def step_info(self, global_step: int) -> StepInfo:
        spe = self.steps_per_epoch
        return StepInfo(
            epoch=global_step // spe,
            epoch_step=global_step % spe,
            global_step=global_step,
            steps_per_epoch=spe,
        )


def plan_run(
    trainer: Any,
    workflow: Any,
    eval_workflow: Any,
    workflow_kwargs: dict[str, Any] | None,
    eval_workflow_kwargs: dict[str, Any] | None,
    dynamic_filter_fn: Any,
    should_accept_fn: Any,
    total_epochs: int | None,
) -> RunPlan:
    """1. The call's inputs, checked and resolved (module docstring)."""
    config = trainer.config
    if workflow is None and config.rollout.agent.mode != "online":
        raise ValueError(
            "train(workflow=...) is required: an instance, a class or an import string "
            "(or rollout.agent.mode='online', where external clients drive the episodes)"
        )
    if dynamic_filter_fn is not None and should_accept_fn is not None:
        raise ValueError(
            "train(): give dynamic_filter_fn or its old name should_accept_fn, not both"
        )
    # Agents (objects with `async def run(data, **extra_kwargs)`) run through the proxy.
    workflow, workflow_kwargs = trainer._agents.wrap(workflow, workflow_kwargs)
    if eval_workflow is not None:
        eval_workflow, eval_workflow_kwargs = trainer._agents.wrap(
            eval_workflow, eval_workflow_kwargs, for_eval=True
        )
    if dynamic_filter_fn is None:
        dynamic_filter_fn = should_accept_fn
    if dynamic_filter_fn is None and config.actor.dynamic_sampling:
        dynamic_filter_fn = ALL_EQUAL_FILTER
    total_steps = trainer.ft_spec.total_train_steps
    steps_per_epoch = trainer.ft_spec.steps_per_epoch
    if total_epochs is not None:
        if total_epochs <= 0:
            raise ValueError(f"train(total_epochs={total_epochs}): must be positive")
        total_steps = total_epochs * steps_per_epoch
        if config.total_train_steps is not None:
            total_steps = min(total_steps, config.total_train_steps)
    return RunPlan(
        workflow=workflow,
        workflow_kwargs=workflow_kwargs,
        eval_workflow=eval_workflow,
        eval_workflow_kwargs=eval_workflow_kwargs,
        dynamic_filter_fn=dynamic_filter_fn,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        evaluates=trainer.valid_dataset is not None and eval_workflow is not None,
    )


def resume(trainer: Any) -> RecoverInfo | None:
    """2. Load the recover checkpoint, if any; ``trainer.start_step`` follows it."""
    info: RecoverInfo | None = trainer.recover_handler.load(
        trainer.actor,
        trainer.saver,
        trainer.evaluator,
        trainer.stats_logger,
        trainer.train_dataloader,
        inference_engine=trainer.rollout,
        weight_sync=trainer.weight_sync,
    )
    if info is not None:
        trainer.start_step = info.last_step_info.next().global_step
        logger.info(f"Resumed from recover checkpoint: continuing at step {trainer.start_step}")
        trainer.health.on_resume(trainer.start_step - 1)
    return info


def evaluate_before(trainer: Any, plan: RunPlan, result: dict[str, Any]) -> None:
    """3. The score before the first update, logged as step -1."""
    if trainer.start_step != 0 or not trainer.config.evaluator.eval_before_train:
        return
    if not plan.evaluates:
        return
    result["initial_eval"] = trainer._evaluate(
        plan.eval_workflow, plan.eval_workflow_kwargs, global_step=0
    )
    trainer.stats_logger.commit(0, -1, -1, dict(result["initial_eval"]))
    trainer.health.add_eval(-1, result["initial_eval"])


def run_steps(
    trainer: Any,
    plan: RunPlan,
    result: dict[str, Any],
    resumed: bool,
    max_seconds: float | None,
) -> None:
    """4. The step loop (module docstring); ``result["steps_done"]`` follows it."""
    from tqdm import tqdm

    from areal.utils.stop_signals import StopOnSignal

    pbar = tqdm(
        total=plan.total_steps, initial=trainer.start_step, desc="train", dynamic_ncols=True
    )
    trainer._t_run, trainer._eval_seconds = time.monotonic(), 0.0
    # SIGTERM/SIGINT: a wait for a batch ends at once (WaitInterrupted), a step past its
    # rollout finishes; the recover checkpoint of the last completed step is written and
    # the run stops (exit 128+sig, in finish)
    trainer._stop = StopOnSignal().install()
    trainer.rollout.workflow_executor.interrupt_waits_on(trainer._stop.event)
    last_dumped = trainer.start_step - 1 if resumed else None
    global_step = trainer.start_step - 1
    while global_step + 1 < plan.total_steps:
        global_step += 1
        step_info = plan.step_info(global_step)
        try:
            with perf_tracer.trace_scope("trainer.train_step", perf_tracer.Category.COMPUTE):
                stats = trainer._train_step(
                    step_info,
                    plan.workflow,
                    plan.workflow_kwargs,
                    plan.dynamic_filter_fn,
                    final=global_step == plan.total_steps - 1,
                )
        except WaitInterrupted:
            trainer._stop_during_wait(global_step, last_dumped)
            break
        # run health: alarms on this step's stats, before its recover checkpoint
        verdict = trainer.health.check(global_step, stats)
        if verdict.kind == "rolled_back":
            global_step = last_dumped = verdict.next_step - 1
            pbar.n = verdict.next_step
            pbar.refresh()
            result.setdefault("health_rollbacks", []).append(verdict.event)
            continue
        if verdict.kind == "stop":
            trainer.stats_logger.commit(step_info.epoch, step_info.epoch_step, global_step, stats)
            result["steps_done"] = global_step + 1 - trainer.start_step
            result["health_stop"] = verdict.message
            break
        with stats_tracker.record_timing("checkpoint_for_recover"):
            dumped = trainer._dump_recover(step_info, force=trainer._stop.requested)
        if dumped is not None:
            last_dumped = global_step
        trainer.rollout.resume()
        after_step(trainer, plan, step_info, stats)
        pbar.set_postfix(reward=f"{stats.get('batch/reward', float('nan')):.3f}")
        pbar.update(1)
        result["steps_done"] = global_step + 1 - trainer.start_step
        if _stops_after(trainer, step_info, dumped, max_seconds):
            break
    pbar.close()


def after_step(trainer: Any, plan: RunPlan, step_info: StepInfo, stats: dict) -> None:
    """Evaluation when due, the save, the step's log line (stats gain the eval scores)."""
    epoch, step, global_step = step_info.epoch, step_info.epoch_step, step_info.global_step
    evaluated = None
    t_eval = time.monotonic()
    if plan.evaluates:
        evaluated = trainer.evaluator.evaluate(
            lambda gs=global_step: trainer._evaluate(
                plan.eval_workflow, plan.eval_workflow_kwargs, gs + 1
            ),
            epoch,
            step,
            global_step,
        )
    trainer._eval_seconds += time.monotonic() - t_eval
    if evaluated:
        stats.update(evaluated)
        trainer.health.add_eval(global_step, evaluated)
    with stats_tracker.record_timing("save"):
        trainer.saver.save(trainer.actor, epoch, step, global_step, tokenizer=trainer.tokenizer)
    stats["time/elapsed"] = time.monotonic() - trainer._t_run
    stats["time/train_elapsed"] = trainer.training_seconds()
    trainer.stats_logger.commit(epoch, step, global_step, stats)
    flush_perf_tracer(trainer.config, global_step)


def _stops_after(trainer: Any, step_info: StepInfo, dumped: Any, max_seconds: float | None) -> bool:
    """A stop signal arrived (the step's recover checkpoint is made sure of) or
    ``max_seconds`` of training have passed."""
    global_step = step_info.global_step
    if trainer._stop.requested:
        if dumped is None:  # the signal came after this step's (skipped) dump
            trainer._dump_recover(step_info, force=True)
        logger.warning(
            f"Stopped by {trainer._stop.name} after step {global_step} "
            "(recover checkpoint written; a rerun resumes from it)"
        )
        return True
    if max_seconds is not None and trainer.training_seconds() >= max_seconds:
        logger.info(f"Stopping after {global_step + 1} steps: max_seconds={max_seconds} reached")
        return True
    return False


def finish(trainer: Any, plan: RunPlan, result: dict[str, Any]) -> dict[str, Any]:
    """5. Flush, honour a stop signal, the final evaluation, the summary."""
    trainer.weight_sync.flush()  # hooks' work left running after the last sync
    trainer._stop.uninstall()
    if trainer._stop.requested:  # close() (the caller's with-block) tears children down
        raise SystemExit(128 + trainer._stop.signum)
    result["train_seconds"] = trainer.training_seconds()
    result["eval_seconds"] = trainer._eval_seconds
    done = trainer.start_step + result.get("steps_done", 0)
    if plan.evaluates:
        last = trainer.eval_history[-1] if trainer.eval_history else None
        if last is not None and last["global_step"] == done:
            result["final_eval"] = {k: v for k, v in last.items() if k != "global_step"}
        else:
            result["final_eval"] = trainer._evaluate(
                plan.eval_workflow, plan.eval_workflow_kwargs, global_step=done
            )
    result["total_steps"] = done
    result["log_dir"] = trainer.log_dir
    return result
