"""Old path of ``WorkflowExecutor``, kept as a re-export.

The code lives in ``areal.infra.rollout.workflow_executor``.
"""

from areal.infra.rollout.workflow_executor import (
    WorkflowExecutor,
    check_trajectory_format,
)

__all__ = ["WorkflowExecutor", "check_trajectory_format"]
