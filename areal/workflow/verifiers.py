"""verifiers environments as rollout workflows (``areal.workflow.verifiers``).

A `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment (the format
of Prime Intellect's Environments Hub: ``load_environment(**args)`` returns a
``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ... with a dataset, a parser and a
``Rubric`` of weighted reward functions) trains unchanged:

- :class:`VerifiersAgent` is an *agent* (``async run(data, **extra_kwargs)``): the
  trainer runs it through the OpenAI-compatible proxy, so every model call the
  environment makes is captured with its tokens and log-probabilities (one training row
  per call, as for the agent SDK modules). ``load_environment`` is called once per
  process (environment id or module, and its arguments, from ``workflow_kwargs``).
- Each episode runs the environment's own ``rollout`` (single-turn, multi-turn and tool
  loops are the environment's) against the proxy with verifiers'
  ``OpenAIChatCompletionsClient``, then its rubric scores it: the weighted sum of its
  reward functions is the episode's reward (the reward of its last call). Rubrics with
  group reward functions (plural arguments: ``completions``, ``states``, ...) are scored
  once per group: the ``group_size`` episodes of a row (``gconfig.n_samples``) wait for
  each other, then ``rubric.score_group`` scores them together.
- :func:`environment_datasets` gives the environment's dataset (training) and eval
  dataset (evaluation) as rows the trainer takes (``prompt``, ``answer``, ``info``,
  ``task``, ``example_id``, and ``messages`` = ``prompt``).

Failures, handled like a failing reward function: an exception in a reward function is
counted (``rollout/verifiers_reward_fn_errors``), logged with its cause and scored 0.0 (verifiers'
own rule); an environment that raises during the rollout, ends with an error, returns no
reward or runs past ``timeout`` seconds fails its episode, which the proxy workflow
counts (``rollout/agent_failed``) and rejects: the run goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import inspect
import json
import math
import threading
from typing import Any

from areal.infra.rollout import workflow_context
from areal.utils import logging, stats_tracker

logger = logging.getLogger("VerifiersAgent")

_ENVS: dict[str, Any] = {}
_ENVS_LOCK = threading.Lock()
# the reward-function failures of the episode being scored
_ERRORS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "areal_verifiers_errors", default=None
)


def _import_vf():
    try:
        import verifiers as vf
    except ImportError as e:
        raise ImportError(
            "areal.workflow.verifiers needs the verifiers package: pip install 'areal[envs]' "
            "(make setup installs it)"
        ) from e
    return vf


def _key(env: str, env_args: dict[str, Any] | None) -> str:
    return json.dumps([env, env_args or {}], sort_keys=True, default=repr)


def load_environment(env: str, env_args: dict[str, Any] | None = None) -> Any:
    """The environment ``env`` with ``env_args``, loaded once per process.

    ``env``: an environment id as verifiers resolves it (``vf.load_environment``: the
    installed module ``env.replace('-', '_')``), or ``"module:function"`` for a loader of
    one's own. Its rubric's reward functions are wrapped so that their exceptions are
    counted (module docstring)."""
    key = _key(env, env_args)
    with _ENVS_LOCK:
        if key not in _ENVS:
            vf = _import_vf()
            if ":" in env:
                module, _, fn = env.partition(":")
                loaded = getattr(importlib.import_module(module), fn)(**(env_args or {}))
            else:
                loaded = vf.load_environment(env, **(env_args or {}))
            if not isinstance(loaded, vf.Environment):
                raise TypeError(
                    f"load_environment for {env!r} returned {type(loaded).__name__}, "
                    "not a verifiers Environment"
                )
            _count_rubric_errors(loaded.rubric)
            _ENVS[key] = loaded
            logger.info("verifiers environment %s loaded (%s)", env, type(loaded).__name__)
        return _ENVS[key]


def _rubrics(rubric: Any):
    yield rubric
    for sub in getattr(rubric, "rubrics", None) or []:
        yield from _rubrics(sub)


def _count_rubric_errors(rubric: Any) -> None:
    """Wrap every reward function of ``rubric`` (and of the rubrics it groups) so that an
    exception is recorded for the episode before verifiers scores it 0.0."""
    for r in _rubrics(rubric):
        r.funcs = [_counted(f) for f in r.funcs]


def _counted(func: Any) -> Any:
    if getattr(func, "_areal_counted", False):
        return func

    @functools.wraps(func)
    async def wrapper(*args, **kwargs):
        try:
            out = func(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except Exception as e:
            errors = _ERRORS.get()
            if errors is not None:
                errors.append(f"{getattr(func, '__name__', func)}: {type(e).__name__}: {e}")
            raise

    wrapper._areal_counted = True
    return wrapper


def _rows(ds: Any) -> list[dict[str, Any]]:
    rows = []
    for row in ds:
        row = dict(row)
        if isinstance(row.get("info"), dict):
            row["info"] = json.dumps(row["info"])  # one column type across rows
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            row["messages"] = prompt
        rows.append(row)
    return rows


def environment_datasets(
    env: str, env_args: dict[str, Any] | None = None, n: int = -1, n_eval: int = -1
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(train rows, eval rows or None)``: the environment's dataset and eval dataset
    (``n`` / ``n_eval`` rows, ``-1``: all) as rows for ``PPOTrainer``."""
    environment = load_environment(env, env_args)
    train = None
    if environment.dataset is not None or environment.dataset_source is not None:
        train = _rows(environment.get_dataset(n=n))
    evals = None
    if environment.eval_dataset is not None or environment.eval_dataset_source is not None:
        evals = _rows(environment.get_eval_dataset(n=n_eval))
    if train is None:
        if evals is None:
            raise ValueError(f"verifiers environment {env!r} has no dataset")
        logger.warning("environment %s has no training dataset: training on its eval set", env)
        train = evals
    return train, evals


class _GroupBarrier:
    """The members of one group (``size`` episodes) meet here to be scored together."""

    def __init__(self, size: int):
        self.size = size
        self.states: list[Any] = []
        self.arrived = 0
        self.done = asyncio.Event()
        self.errors: list[str] = []
        self.failure: BaseException | None = None
        self.scorer: Any = None


class VerifiersAgent:
    """A verifiers environment as an agent (module docstring).

    Args:
        env: environment id (``vf.load_environment``) or ``"module:function"``.
        env_args: ``load_environment``'s keyword arguments.
        sampling_args: the sampling arguments of every model call (``temperature``,
            ``max_tokens``, ``top_p``, ...), merged over the environment's own.
        timeout: seconds one episode (rollout and scoring) may take; past it the
            episode fails (a hang never stalls the run).
        group_size: episodes per row in training (``gconfig.n_samples``); used only by
            rubrics with group reward functions. ``eval_group_size``: the same in
            evaluations (``eval_gconfig.n_samples``).
        model: the model name sent to the proxy.
        kwargs: AReaL-style sampling kwargs (``temperature``, ``top_p``,
            ``max_completion_tokens``/``max_tokens``) added to ``sampling_args``.
    """

    def __init__(
        self,
        env: str,
        env_args: dict[str, Any] | None = None,
        sampling_args: dict[str, Any] | None = None,
        timeout: float = 600.0,
        group_size: int = 1,
        eval_group_size: int = 1,
        model: str = "default",
        **kwargs: Any,
    ):
        if not isinstance(env, str) or not env:
            raise ValueError(f"env={env!r}; give an environment id or 'module:function'")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout}; must be > 0")
        if group_size < 1 or eval_group_size < 1:
            raise ValueError(f"group_size={group_size}, eval_group_size={eval_group_size}; >= 1")
        self.env = env
        self.env_args = dict(env_args or {})
        self.sampling_args = dict(sampling_args or {})
        for k in ("temperature", "top_p", "max_tokens", "max_completion_tokens"):
            if k in kwargs:
                self.sampling_args.setdefault(k, kwargs.pop(k))
        if "max_completion_tokens" in self.sampling_args:
            self.sampling_args["max_tokens"] = self.sampling_args.pop("max_completion_tokens")
        self.timeout = float(timeout)
        self.group_size = int(group_size)
        self.eval_group_size = int(eval_group_size)
        self.model = model
        self._groups: dict[Any, _GroupBarrier] = {}

    def __getstate__(self):  # picklable for the proxy's subproc mode
        state = dict(self.__dict__)
        state["_groups"] = {}
        return state

    def environment(self) -> Any:
        return load_environment(self.env, self.env_args)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        vf = _import_vf()
        from openai import AsyncOpenAI

        env = self.environment()
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(
                base_url=extra_kwargs.get("base_url"),
                api_key=extra_kwargs.get("api_key"),
                http_client=extra_kwargs.get("http_client"),
                max_retries=0,
            )
        )
        rollout_input = {k: data[k] for k in ("prompt", "answer", "info", "task") if k in data}
        if "prompt" not in rollout_input:
            rollout_input["prompt"] = data["messages"]
        rollout_input["example_id"] = data.get("example_id", 0)
        ctx = workflow_context.get()
        grouped = env.rubric.has_group_rewards
        size = self.eval_group_size if ctx.is_eval else self.group_size
        barrier = None
        if grouped:
            barrier = self._groups.setdefault(ctx.task_id, _GroupBarrier(size))
        try:
            return await asyncio.wait_for(
                self._episode(env, client, rollout_input, barrier), self.timeout
            )
        except TimeoutError:
            raise TimeoutError(
                f"verifiers environment {self.env!r}: episode ran past timeout={self.timeout}s"
            ) from None
        finally:
            if barrier is not None and barrier.done.is_set():
                self._groups.pop(ctx.task_id, None)

    async def _episode(self, env: Any, client: Any, rollout_input: dict, barrier) -> float:
        state = None
        try:
            state = await env.rollout(rollout_input, client, self.model, self._sampling(env))
        finally:
            if barrier is not None:
                await self._arrive(env, barrier, state)
        if barrier is None:
            errors: list[str] = []
            token = _ERRORS.set(errors)
            try:
                await env.rubric.score_rollout(state)
            finally:
                _ERRORS.reset(token)
            await env.rubric.cleanup(state)
        else:
            await barrier.done.wait()
            if barrier.failure is not None:
                raise barrier.failure
            errors = barrier.errors if barrier.scorer is asyncio.current_task() else []
        self._record_errors(errors)
        if state.get("error") is not None:
            raise RuntimeError(f"verifiers environment {self.env!r} failed: {state['error']!r}")
        reward = state.get("reward")
        if reward is None or not math.isfinite(float(reward)):
            raise ValueError(f"verifiers environment {self.env!r} returned no reward ({reward})")
        return float(reward)

    async def _arrive(self, env: Any, barrier: _GroupBarrier, state: Any) -> None:
        barrier.arrived += 1
        if state is not None:
            barrier.states.append(state)
        if barrier.arrived < barrier.size:
            return
        barrier.scorer = asyncio.current_task()  # counts the group's reward-fn errors
        token = _ERRORS.set(barrier.errors)
        try:
            if barrier.states:
                await env.rubric.score_group(barrier.states)
                for s in barrier.states:
                    await env.rubric.cleanup(s)
        except Exception as e:
            barrier.failure = e
        finally:
            _ERRORS.reset(token)
            barrier.done.set()

    def _sampling(self, env: Any) -> dict[str, Any]:
        args = dict(env.sampling_args or {})
        args.update(self.sampling_args)
        return args

    def _record_errors(self, errors: list[str]) -> None:
        scope = stats_tracker.get(workflow_context.stat_scope())
        scope.scalar(verifiers_reward_fn_errors=float(len(errors)))
        for err in errors:
            logger.warning("environment %s: reward function raised (scored 0.0): %s", self.env, err)
