"""Old path of ``AsyncTaskRunner``, kept as a re-export.

The code lives in ``areal.infra.rollout.async_task_runner``.
"""

from areal.infra.rollout.async_task_runner import (
    AsyncTaskRunner,
    TaskQueueFullError,
    TimedResult,
)

__all__ = ["AsyncTaskRunner", "TaskQueueFullError", "TimedResult"]
