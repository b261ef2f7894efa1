"""Old path of ``workflow_context`` (AReaL: ``from areal.infra import workflow_context``), kept as a re-export.

The code lives in ``areal.infra.rollout.workflow_context``. The functions are the same objects,
so the context they read and write is the one of that module.
"""

from areal.infra.rollout.workflow_context import (  # noqa: A004 - AReaL's names
    WorkflowContext,
    get,
    seed_parts,
    set,
    stat_scope,
    with_sample_index,
)

__all__ = ["WorkflowContext", "get", "seed_parts", "set", "stat_scope", "with_sample_index"]
