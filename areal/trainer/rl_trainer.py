"""PPOTrainer: the single controller of an RL run.

The user's script is the controller::

    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=...)

or, online (``rollout.agent.mode='online'``: external clients play the episodes through
the proxy; ``trainer_wiring.online_dataset`` says how many sessions make a step),
``PPOTrainer(config)`` and ``trainer.train()``.

The trainer starts the workers named by the allocation mode through a scheduler
(training workers of each role, one ``TrainController`` each, started by
``start_train_controller``; then the inference servers, started while the training
engines are built), runs the rollout side
(``RemoteInfEngine`` + ``WorkflowExecutor``) in this process, and drives each step:

1. ``server_watchdog.check()`` (dead servers come back) and ``weight_sync.flush()``
   (weight-sync hooks finish work they left running after the last sync; the built-in
   weight check is not among it: the commit waits for it);
2. rollout: ``prepare_batch`` (asynchronous) or one batch generated after the last
   update (``_sync_rollout``); batch stats (``areal.trainer.ppo.stats``) and the
   ``consumed.jsonl`` audit line. Episodes that keep failing end the wait with
   ``RolloutFailureError`` (``areal.infra.rollout.failure_monitor``); a SIGTERM/SIGINT
   ends it with ``WaitInterrupted``: the recover checkpoint of the last completed step is
   written and the run exits 128 + signal (``_stop_during_wait``);
3. the training half on the workers (``areal.trainer.rl_step.train_on_batch``): the
   batch crosses to each role's workers once; proximal logprobs, reference / teacher
   logprobs, values, advantages, ``ppo_update``, LR step; held batches freed;
4. ``weight_sync.sync``: pause, push weights, bump versions (rollout stays paused);
   with ``deterministic`` first ``wait_for_pinned_waves`` (every rollout pinned to the
   current version has finished: ``areal.infra.rollout.rollout_deterministic``);
4b. run health (``areal.trainer.health``): the step's alarms; ``stop`` ends the run
   here, ``rollback`` restores an earlier recover checkpoint and the loop goes on from it;
5. the recover checkpoint, then ``rollout.resume()``;
6. evaluation when due (``areal.utils.evaluator``: ``Evaluator`` + ``run_evaluation``),
   ``saver.save``, ``stats_logger.commit``.

Agents (``async def run(data, **extra_kwargs)``) run through the OpenAI-compatible proxy
(``areal.experimental.openai.proxy.trainer_wiring.TrainerAgentProxy``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from areal.api.alloc_mode import AllocationMode
from areal.api.cli_args import BaseExperimentConfig, PPOConfig
from areal.api.io_struct import StepInfo, WeightUpdateMeta
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.proxy.trainer_wiring import TrainerAgentProxy, online_dataset
from areal.inference.teacher import ServerTeacher, uses_server_teacher
from areal.infra import stack_dump
from areal.infra.controller.train_controller import start_train_controller
from areal.infra.rollout import workflow_context
from areal.infra.rollout.failure_monitor import EpisodeFailureMonitor
from areal.infra.rollout.grouped_workflow import (
    GroupedRolloutWorkflow,
    interactions_to_tensor_dict,
    is_interaction_dict,
)
from areal.trainer import rl_run
from areal.trainer.common import make_scheduler, setup_run, teardown_run
from areal.trainer.cpu_handoff import CpuThreadHandoff
from areal.trainer.engine_select import select_engine
from areal.trainer.health import TrainerHealth
from areal.trainer.ppo.stats import batch_stats
from areal.trainer.rl_step import PPORoles, train_on_batch
from areal.utils import logging, perf_tracer, stats_tracker
from areal.utils.dynamic_import import import_from_string
from areal.utils.evaluator import Evaluator, run_evaluation
from areal.utils.recover import RecoverHandler
from areal.utils.saver import Saver
from areal.utils.stats_logger import StatsLogger

logger = logging.getLogger("PPOTrainer")


def limit_cpu_controller_threads(config: BaseExperimentConfig) -> bool:
    """On a CPU run (``cluster.n_gpus_per_node == 0``) give this controller process one
    torch thread; returns whether it changed the count.

    The controller's tensor work is small (batch slicing, padding, statistics) and the
    cores belong to the workers and servers; with more OpenMP threads than free cores
    every op waits at barriers for threads they deschedule, and spinning threads take
    CPU from them (slicing a 128-row batch: 0.16 ms at 1 thread, 4.5 ms at 2).
    """
    if config.cluster.n_gpus_per_node != 0 or torch.get_num_threads() <= 1:
        return False
    logger.info("CPU run: controller torch threads %d -> 1", torch.get_num_threads())
    torch.set_num_threads(1)
    return True


ACTOR_ENGINE = "areal.trainer.ppo.actor.FSDPPPOActor"
CRITIC_ENGINE = "areal.trainer.ppo.critic.FSDPPPOCritic"


def resolve_allocation(config: PPOConfig) -> AllocationMode:
    """Allocation from ``allocation_mode`` or, when empty, from ``rollout.backend`` + ``actor.backend``."""
    if config.allocation_mode:
        return AllocationMode.from_str(config.allocation_mode)
    rb = config.rollout.backend or ""
    ab = config.actor.backend or ""
    if rb and ab:
        return AllocationMode.from_str(f"{rb}+{ab}")
    raise ValueError(
        "allocation_mode is empty and rollout.backend/actor.backend are not both set; "
        "give e.g. allocation_mode='local:d1+fsdp:d1'"
    )


# perf-tracer span names of the timed phases whose timing key would be ambiguous
# ("trainer.train_step" is the whole step)
_SPAN_NAMES = {"train_step": "ppo_update"}


class PPOTrainer:
    """Asynchronous PPO/GRPO trainer (see module docstring)."""

    # the trainer's idle cores for the built-in servers (made in __init__; off otherwise)
    cpu_handoff = CpuThreadHandoff(None, enabled=False)

    def __init__(self, config: PPOConfig, train_dataset: Any = None, valid_dataset: Any = None):
        self.config = config
        self._closed = False
        limit_cpu_controller_threads(config)
        self.alloc_mode = resolve_allocation(config)
        self._agents: TrainerAgentProxy | None = None  # made once the rollout engine is up
        self._roles_started: list = []  # TrainControllers, in start order (_start_role)
        if train_dataset is None:
            # Online mode (AReaL's entry, ``PPOTrainer(config)``): empty episode slots.
            train_dataset = online_dataset(config)
        run = setup_run(config, train_dataset, model_path=config.actor.path)
        self.log_dir, self.tokenizer = run.log_dir, run.tokenizer
        # before any process starts: hung waits (and SIGUSR1) dump every process's stacks
        stack_dump.enable(os.path.join(self.log_dir, "stacks"))
        self.train_dataloader, self.ft_spec = run.train_dataloader, run.ft_spec
        self.train_dataset = train_dataset
        self.valid_dataset = valid_dataset

        try:
            self.scheduler = make_scheduler(config)
            # The training workers' processes first, then the inference servers and the
            # rollout client, without waiting in between: the workers come up and build
            # their engines (model load, FSDP wrap) on a thread while the servers start
            # (each process spends seconds importing torch). The trainer forms groups of
            # gconfig.n_samples rows: the data-parallel split keeps each group on one rank
            # (group normalisation needs the whole group).
            self.actor = self._start_role(
                "actor", ACTOR_ENGINE, config.actor, group_size=_dispatch_group_size(config)
            )
            use_ref = config.ref is not None and config.actor.kl_ctl > 0
            self.ref = self._start_role("ref", ACTOR_ENGINE, config.ref) if use_ref else None
            # On-policy distillation: a frozen teacher scores every trajectory (built-in
            # servers' /score when teacher.engine_type=rollout has a local: backend).
            self.teacher = (
                ServerTeacher.launch(config.teacher)
                if uses_server_teacher(config.teacher)
                else self._start_role("teacher", ACTOR_ENGINE, config.teacher)
            )
            self.critic = self._start_role("critic", CRITIC_ENGINE, config.critic)
            self.rollout = self._start_rollout()
            for controller in self._roles_started:
                controller.wait_ready()
            self._agents = TrainerAgentProxy(
                config.rollout, self.rollout, self.tokenizer, scheduler=self.scheduler
            )
            self.weight_update_meta = self._make_weight_update_meta()
            self.actor.connect_engine(self.rollout, self.weight_update_meta)
            self.weight_sync = self._make_weight_sync()
            if config.rollout.verify_weights and not config.actor.use_lora:
                from areal.infra.weights.weight_verify import WeightFingerprintHook

                # every server's weights are checked against the trainer's after each push
                self.weight_sync.add_hook(
                    WeightFingerprintHook(
                        full_every=config.rollout.verify_weights_full_every,
                        background=config.rollout.verify_weights_background,
                        in_response=config.rollout.verify_weights_in_response,
                    )
                )
            self.server_watchdog = self._make_server_watchdog()
            self.cpu_handoff = CpuThreadHandoff(self.rollout, config.rollout.cpu_thread_handoff)
        except BaseException:
            self.close()
            raise

        self.saver = Saver(config.saver, self.ft_spec)
        self.evaluator = Evaluator(config.evaluator, self.ft_spec)
        self.stats_logger = StatsLogger(config.stats_logger, self.ft_spec)
        self.recover_handler = RecoverHandler(config.recover, self.ft_spec)
        # alarms on every step's statistics; stop / rollback (areal.trainer.health)
        self.health = TrainerHealth(self)
        self.start_step = 0
        self.eval_history: list[dict[str, float]] = []

    # ------------------------------------------------------------------ set-up
    def _start_role(self, role: str, engine: str, role_config: Any, group_size: int | None = None):
        """The started ``TrainController`` of ``role`` (None when ``role_config`` is None)."""
        if role_config is None:
            return None
        engine = select_engine(engine, role_config, self.alloc_mode)  # fsdp or archon
        previous = self._roles_started[-1] if self._roles_started else None
        controller = start_train_controller(
            engine,
            role_config,
            self.scheduler,
            role,
            alloc_mode=self.alloc_mode,
            ft_spec=self.ft_spec,
            group_size=group_size,
            seed=self.config.seed,
            # engines built in the background, one role after the other (roles may share
            # workers); __init__ calls wait_ready() once the servers are started
            wait=False,
            after=previous,
        )
        self._roles_started.append(controller)
        return controller

    def _start_rollout(self):
        """Start the servers of the allocation's inference backend and connect its client.

        The backend name (``local``/``vllm``/``sglang``) picks, from the registry
        ``areal.inference.backends``, both the server command (flags from
        ``config.vllm`` / ``config.sglang``) and the client engine speaking its protocol.
        """
        from areal.inference import backends as inference_backends
        from areal.infra.scheduler.servers import launch_inference_servers

        backend = self.alloc_mode.gen_backend
        gen = self.alloc_mode.gen
        command, env = inference_backends.server_command(
            backend,
            self.config,
            model_path=self.config.actor.path,
            tp_size=getattr(gen, "tp_size", 1) if gen is not None else 1,
            pp_size=getattr(gen, "pp_size", 1) if gen is not None else 1,
        )
        key_env = self.config.rollout.generation_api_key_env
        if key_env:  # generation endpoints require this key (areal.utils.auth)
            from areal.utils.auth import SERVER_API_KEY_ENV

            if not os.environ.get(key_env):
                raise ValueError(
                    f"rollout.generation_api_key_env={key_env!r}: that environment variable is "
                    "not set (or empty) in the controller"
                )
            env = {**(env or {}), SERVER_API_KEY_ENV: os.environ[key_env]}
        addrs = launch_inference_servers(
            self.scheduler, self.alloc_mode, command, env, config=self.config
        )
        engine = inference_backends.make_inference_engine(backend, self.config.rollout)
        # One executor in the controller produces the whole batch for all training ranks.
        engine.initialize(addr=addrs, train_data_parallel_size=1)
        return engine

    def _make_weight_sync(self):
        """The one object that pauses, pushes weights, sets versions and resumes
        (``areal.infra.weight_sync``); add hooks with ``trainer.weight_sync.add_hook``."""
        from areal.infra.weights.weight_sync import WeightSynchronizer

        c = self.config
        scratch = os.path.join(
            c.cluster.fileroot, "checkpoints", c.experiment_name, c.trial_name, "server_restart"
        )
        hooks = []
        if c.actor.use_lora and c.actor.weight_update_mode == "disk":
            from areal.engine.lora import LoRASyncHook

            # adapter-only pushes under versioned names (xccl sends merged full weights)
            hooks.append(LoRASyncHook(lora_name=f"{c.experiment_name}-lora"))
        return WeightSynchronizer(
            self.actor,
            self.rollout,
            self.weight_update_meta,
            critic=self.critic,
            hooks=hooks,
            scratch_dir=scratch,
            max_consecutive_refusals=c.rollout.max_consecutive_weight_sync_refusals,
            initial_weights_path=c.actor.path,
        )

    def _make_server_watchdog(self):
        from areal.infra.weights.server_watchdog import ServerWatchdog

        return ServerWatchdog(self.scheduler, self.rollout, weight_sync=self.weight_sync)

    def _make_weight_update_meta(self) -> WeightUpdateMeta:
        from areal.infra.weights.transports import with_delta  # actor.enable_delta_...

        if self.config.actor.weight_update_mode == "disk":
            c = self.config
            meta = WeightUpdateMeta.from_disk(
                c.experiment_name, c.trial_name, c.cluster.fileroot, alloc_mode=self.alloc_mode
            )
            return with_delta(meta, c.actor)
        from areal.utils.network import find_free_ports

        # The group's rank 0 is training worker 0, which may be on another node than this
        # controller: the servers must dial that worker's address, never this loopback.
        workers = getattr(self.actor, "workers", None) or []
        master = workers[0].ip if workers else "127.0.0.1"
        meta = WeightUpdateMeta.from_fsdp_xccl(
            allocation_mode=self.alloc_mode,
            master_address=master,
            master_port=find_free_ports(1)[0],
            backend=None,
            timeout_s=self.config.actor.weight_update_timeout,
        )
        return with_delta(meta, self.config.actor)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> PPOTrainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_stop", None) is not None:
            self._stop.uninstall()
        if getattr(self, "_agents", None) is not None:
            self._agents.stop()
        teardown_run(self, ("rollout", "critic", "teacher", "ref", "actor"))

    # ------------------------------------------------------------------ train
    def train(
        self,
        workflow: RolloutWorkflow | type | str | None = None,
        eval_workflow: RolloutWorkflow | type | str | None = None,
        workflow_kwargs: dict[str, Any] | None = None,
        eval_workflow_kwargs: dict[str, Any] | None = None,
        dynamic_filter_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        total_epochs: int | None = None,
        *,
        should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None,
        max_seconds: float | None = None,
    ) -> dict[str, Any]:
        """Run until ``total_train_steps`` (or epochs); returns a summary dict.

        AReaL's signature and semantics: every workflow (training and evaluation) is run
        ``gconfig.n_samples`` (``eval_gconfig.n_samples``) times per prompt and the group
        concatenated, so a workflow returns one trajectory per call and a batch holds
        ``train_dataset.batch_size`` whole groups. ``dynamic_filter_fn(group) -> bool``
        (callable or import string) drops whole groups; rejected groups are replaced, or,
        with ``config.dynamic_bs``, the batch shrinks instead. ``should_accept_fn`` is the
        older name of ``dynamic_filter_fn``; ``actor.dynamic_sampling`` without a filter
        uses ``areal.utils.dynamic_sampling.dynamic_sampling_accept`` (drop all-equal groups).
        ``total_epochs`` overrides ``config.total_train_epochs``. ``max_seconds``
        (optional, for benchmarks) also stops after that much training wall time,
        measured from the first step, evaluation excluded (see :meth:`training_seconds`).

        The call runs the pieces of ``areal.trainer.rl_run`` in order: plan, resume,
        evaluate before training, the step loop, finish.
        """
        plan = rl_run.plan_run(
            self,
            workflow,
            eval_workflow,
            workflow_kwargs,
            eval_workflow_kwargs,
            dynamic_filter_fn,
            should_accept_fn,
            total_epochs,
        )
        recover_info = rl_run.resume(self)
        result: dict[str, Any] = {"start_step": self.start_step}
        rl_run.evaluate_before(self, plan, result)
        rl_run.run_steps(self, plan, result, recover_info is not None, max_seconds)
        return rl_run.finish(self, plan, result)

    def _dump_recover(self, step_info: StepInfo, force: bool) -> Any:
        """The recover checkpoint of ``step_info`` (actor, saver, evaluator, stats logger,
        dataloader, rollout state, tokenizer); ``force``: also when it is not due."""
        return self.recover_handler.dump(
            self.actor,
            step_info,
            self.saver,
            self.evaluator,
            self.stats_logger,
            self.train_dataloader,
            inference_engine=self.rollout,
            tokenizer=self.tokenizer,
            force=force,
        )

    def _stop_during_wait(self, global_step: int, last_dumped: int | None) -> None:
        """A stop signal ended the wait for step ``global_step``'s batch: write the recover
        checkpoint of the last completed step (unless it exists), from which a rerun
        resumes (the rows drawn since are stored as pending and re-run)."""
        self.rollout.pause()
        done = global_step - 1
        if done < 0:
            logger.warning(
                f"Stopped by {self._stop.name} while waiting for the first batch: no step "
                "completed, no recover checkpoint written"
            )
            return
        if last_dumped != done:
            spe = self.ft_spec.steps_per_epoch
            with stats_tracker.record_timing("checkpoint_for_recover"):
                step = StepInfo(
                    epoch=done // spe, epoch_step=done % spe, global_step=done, steps_per_epoch=spe
                )
                self._dump_recover(step, force=True)
        logger.warning(
            f"Stopped by {self._stop.name} while waiting for the batch of step {global_step} "
            f"(recover checkpoint of step {done} written; a rerun resumes from it)"
        )

    def training_seconds(self) -> float:
        """Wall time of the current ``train()`` call since its first step, minus the time
        spent in periodic evaluation (0.0 before ``train()`` starts)."""
        t_run = getattr(self, "_t_run", None)
        if t_run is None:
            return 0.0
        return time.monotonic() - t_run - self._eval_seconds

    def _train_step(
        self, step_info: StepInfo, workflow, workflow_kwargs, should_accept_fn, final=False
    ) -> dict[str, float]:
        """One step (module docstring, 1-4); ``final``: the run's last step (a
        deterministic run then does not wait for rollouts no step will train on)."""
        config = self.config
        timings: dict[str, float] = {}

        def timed(name: str):
            # a perf-tracer span too: trainer.rollout, trainer.ppo_update, ...
            span = f"trainer.{_SPAN_NAMES.get(name, name)}"

            class _T:
                def __enter__(s):
                    s.t = time.monotonic()
                    s.span = perf_tracer.trace_scope(span, perf_tracer.Category.COMPUTE)
                    s.span.__enter__()

                def __exit__(s, *a):
                    s.span.__exit__(*a)
                    timings[f"time/{name}"] = time.monotonic() - s.t

            return _T()

        self.server_watchdog.check()  # dead inference servers come back with current weights
        self.weight_sync.flush()  # raises what a hook's work left running found
        # the trainer waits for its batch: the built-in servers of this CPU get its cores
        with timed("rollout"), self.cpu_handoff.waiting():
            # As AReaL: the trainer forms the groups (n_samples runs of the workflow per
            # prompt); the filter sees whole groups.
            group_size = config.gconfig.n_samples
            if config.async_training:
                batch = self.rollout.prepare_batch(
                    self.train_dataloader,
                    workflow=workflow,
                    workflow_kwargs=workflow_kwargs,
                    should_accept_fn=should_accept_fn,
                    group_size=group_size,
                    dynamic_bs=config.dynamic_bs,
                    **_group_options(config),
                )
            else:
                batch = self._sync_rollout(workflow, workflow_kwargs, should_accept_fn, group_size)
        version = step_info.global_step
        stats: dict[str, float] = batch_stats(batch, version)
        stats.update(self.health.batch_signals(batch))
        self._log_consumed(batch, step_info.global_step)
        roles = PPORoles(self.actor, self.ref, self.teacher, self.critic)
        train_stats = train_on_batch(roles, batch, config, version, timed)
        if config.deterministic and config.async_training and not final:
            with timed("wait_pinned_rollouts"):
                # every request of the waves pinned to this version ends before the push
                self.rollout.workflow_executor.wait_for_pinned_waves(version)
        with timed("update_weights"):
            # Pause -> push -> version on actor/critic/rollout -> resume generation. The
            # rollout executor stays paused until the recover checkpoint is written (train
            # loop), so the saved dataloader position matches what training consumed.
            self.weight_sync.sync(version + 1, resume=False)
        self.server_watchdog.check()  # still paused: a restarted server gets the new weights

        stats.update(train_stats)
        stats.update(self.actor.export_stats())
        if self.critic is not None:
            stats.update(self.critic.export_stats())
        stats.update(stats_tracker.export_all())
        stats.update(timings)
        stats.update(self.server_watchdog.step_stats())
        n_tokens = float(batch["attention_mask"].sum())
        train_time = (
            timings["time/compute_logp"]
            + timings["time/compute_advantages"]
            + timings["time/train_step"]
        )
        stats["perf/train_tokens_per_sec"] = n_tokens / max(train_time, 1e-9)
        stats["perf/step_tokens_per_sec"] = n_tokens / max(sum(timings.values()), 1e-9)
        return stats

    def _log_consumed(self, batch: dict[str, torch.Tensor], global_step: int) -> None:
        """Append the prompts (hashes) trained on at this step to ``consumed.jsonl``.

        An audit trail: after a crash and resume, every row of the epoch appears exactly
        once (``tests/test_resume.py`` checks it against an uninterrupted run).
        """
        import hashlib
        import json

        prompt = (batch["attention_mask"].bool() & ~batch["loss_mask"].bool()).numpy()
        ids = batch["input_ids"].numpy()  # numpy rows: ~20x faster to slice than tensors
        hashes = [
            hashlib.sha1(ids[i][prompt[i]].tobytes()).hexdigest()[:16] for i in range(len(ids))
        ]
        path = os.path.join(self.log_dir, "consumed.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"global_step": global_step, "prompts": hashes}) + "\n")

    def _sync_rollout(self, workflow, workflow_kwargs, should_accept_fn, group_size: int):
        """One batch generated after the last update (``async_training=False``).

        Rejected groups are replaced by prompts of the next dataloader batches (only as
        many as still missing; the rest of such a batch is skipped) unless ``dynamic_bs``;
        at ``rollout.max_num_gen_batches`` batches' worth of groups, by filtered groups.
        """
        from areal.utils.batch import concat_padded_tensors

        bs = self.config.train_dataset.batch_size
        executor = getattr(self.rollout, "workflow_executor", None)
        parts, n_groups, draws = [], 0, 0
        while n_groups < bs:
            data = list(next(self._sync_iter()))[: bs - n_groups]
            draws += 1
            part = self.rollout.rollout_batch(
                data,
                workflow=workflow,
                workflow_kwargs=workflow_kwargs,
                should_accept_fn=should_accept_fn,
                group_size=group_size,
                **_group_options(self.config),
            )
            if part:
                parts.append(part)
                accepted = getattr(executor, "last_submit_versions", None)
                if accepted is not None:
                    n_groups += len(accepted)
                elif "group_ids" in part:  # groups of any size (agent calls as rows)
                    n_groups += int(torch.unique(part["group_ids"]).numel())
                else:
                    n_groups += len(part["rewards"]) // group_size
            if self.config.dynamic_bs and parts:
                break
            filler = executor.fill_at_gen_bound(bs - n_groups, bs) if executor else None
            if filler:
                parts.append(filler)
                break
            if draws >= 100 and not parts:
                raise RuntimeError(
                    f"no group accepted in {draws} dataloader batches: check the filter"
                )
        if executor is not None:
            executor.end_step()
        return parts[0] if len(parts) == 1 else concat_padded_tensors(parts)

    def _sync_iter(self):
        if not hasattr(self, "_sync_it"):

            def gen():
                while True:
                    yield from self.train_dataloader

            self._sync_it = gen()
        return self._sync_it

    # ------------------------------------------------------------------ agents
    @property
    def proxy_addr(self) -> str | None:
        """Base URL of the OpenAI-compatible proxy (None until an agent workflow starts it)."""
        return None if self._agents is None else self._agents.base_url

    # ------------------------------------------------------------------ eval
    def _evaluate(self, eval_workflow, eval_workflow_kwargs, global_step: int) -> dict[str, float]:
        """Evaluation over the whole valid set through the servers.

        Runs the episodes directly (not through the WorkflowExecutor), so evaluation never
        mixes with training rollouts or counts against the staleness bound.
        """
        # As AReaL: eval_gconfig.n_samples runs of the workflow per prompt.
        n_eval = self.config.eval_gconfig.n_samples if self.config.eval_gconfig else 1
        wf = _resolve_workflow(eval_workflow, eval_workflow_kwargs)
        if n_eval > 1:
            wf = GroupedRolloutWorkflow(wf, n_eval)

        async def episode(item):
            workflow_context.set(workflow_context.WorkflowContext(is_eval=True))
            out = await wf.arun_episode(self.rollout, item)
            return interactions_to_tensor_dict(out) if is_interaction_dict(out) else out

        rc = self.config.rollout
        with self.cpu_handoff.waiting():  # the trainer is idle: the servers get its cores
            res = run_evaluation(
                episode,
                [self.valid_dataset[i] for i in range(len(self.valid_dataset))],
                max_concurrent=int(rc.max_concurrent_rollouts or 64),
                global_step=global_step,
                # failing evaluation episodes stop the run as training ones do
                failure_monitor=EpisodeFailureMonitor(
                    "evaluation",
                    max_consecutive=rc.max_consecutive_episode_failures,
                    window=rc.episode_failure_window,
                    max_ratio=rc.max_episode_failure_ratio,
                ),
            )
        self.eval_history.append({"global_step": global_step, **res})
        return res


def _group_options(config: PPOConfig) -> dict[str, bool]:
    """AReaL 2.0's group options of the training rollouts (``gconfig``)."""
    return dict(
        reward_normalization=config.gconfig.reward_normalization,
        drop_incomplete_group=config.gconfig.drop_incomplete_group,
    )


def _dispatch_group_size(config: PPOConfig) -> int:
    """Rows that travel together to one data-parallel rank: ``actor.group_size`` when
    set (> 1), else ``gconfig.n_samples`` (AReaL YAMLs leave ``actor.group_size`` unset)."""
    gs = int(config.actor.group_size or 1)
    return gs if gs > 1 else int(config.gconfig.n_samples)


def _resolve_workflow(workflow: Any, kwargs: dict[str, Any] | None) -> RolloutWorkflow:
    """An instance, a class + kwargs, or an import string + kwargs."""
    if isinstance(workflow, RolloutWorkflow):
        return workflow
    if isinstance(workflow, str):
        workflow = import_from_string(workflow)
    if isinstance(workflow, type):
        return workflow(**(kwargs or {}))
    raise TypeError(
        f"workflow must be a RolloutWorkflow instance, class or import string; got {workflow!r}"
    )
