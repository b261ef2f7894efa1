"""What a running workflow episode may know about itself (``contextvars``, per task).

The executor sets a :class:`WorkflowContext` before it calls ``arun_episode``; the trainer
does the same for evaluation episodes; :class:`~areal.infra.rollout.grouped_workflow.GroupedRolloutWorkflow`
sets ``sample_index`` for each member of a group. Every asyncio task has its own copy of
the context, so concurrent episodes never see each other's values.

AReaL's names: ``workflow_context.get()``, ``workflow_context.set(ctx)`` and
``workflow_context.stat_scope()`` (``"eval-rollout"`` during evaluation, else
``"rollout"``). ``sample_index`` is ours: the position of the episode inside its group,
used to derive reproducible per-request sampling seeds; ``data_index`` too (the row's
position in the order a ``deterministic: true`` run drew it, None otherwise).
``seed_parts(prompt_ids, version, *extra)`` is what a workflow hands
``areal.utils.seeding.request_seed``.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from typing import Any

__all__ = ["WorkflowContext", "get", "seed_parts", "set", "stat_scope", "with_sample_index"]


@dataclasses.dataclass(frozen=True)
class WorkflowContext:
    """Execution context of one episode.

    Attributes:
        is_eval: the episode belongs to an evaluation, not to training.
        task_id: the executor's task id (None outside the executor).
        sample_index: position of this episode inside its group (0 when not grouped).
        data_index: position of the row in the draw order of a deterministic run (the
            executor's ``deterministic`` mode); None otherwise.
    """

    is_eval: bool = False
    task_id: int | None = None
    sample_index: int = 0
    data_index: int | None = None


_DEFAULT = WorkflowContext()
_CURRENT: ContextVar[WorkflowContext | None] = ContextVar("areal_workflow_context", default=None)


def set(ctx: WorkflowContext) -> None:  # noqa: A001 - AReaL's name
    """Make ``ctx`` the context of the current task (and of tasks it creates later)."""
    if not isinstance(ctx, WorkflowContext):
        raise TypeError(f"workflow_context.set expects a WorkflowContext, got {type(ctx).__name__}")
    _CURRENT.set(ctx)


def get() -> WorkflowContext:
    """The context of the current task (defaults when none was set)."""
    ctx = _CURRENT.get()
    return _DEFAULT if ctx is None else ctx


def stat_scope() -> str:
    """``"eval-rollout"`` for evaluation episodes, ``"rollout"`` otherwise."""
    return "eval-rollout" if get().is_eval else "rollout"


def with_sample_index(index: int) -> None:
    """Set ``sample_index`` in the current task's context, keeping the other fields."""
    _CURRENT.set(dataclasses.replace(get(), sample_index=int(index)))


def seed_parts(prompt_ids: Any, version: int, *extra: Any) -> tuple[Any, ...]:
    """The identity of one generation request, for ``request_seed(*parts)``.

    In a deterministic run (``data_index`` set): ``("deterministic", data_index,
    sample_index, *extra)``: the row's place in the dataset order, the group member and
    (multi-turn) the turn, nothing that depends on timing. Otherwise the prompt tokens, the
    group member and the policy version (``extra`` appended)."""
    ctx = get()
    if ctx.data_index is not None:
        return ("deterministic", int(ctx.data_index), int(ctx.sample_index), *extra)
    return (tuple(prompt_ids), ctx.sample_index, version, *extra)
