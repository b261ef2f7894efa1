"""Old path of ``GroupedRolloutWorkflow``, kept as a re-export.

The code lives in ``areal.infra.rollout.grouped_workflow``.
"""

from areal.infra.rollout.grouped_workflow import (
    GroupedRolloutWorkflow,
    GroupInteractions,
    interactions_to_tensor_dict,
    is_interaction_dict,
    tag_group_rows,
)

__all__ = [
    "GroupInteractions",
    "GroupedRolloutWorkflow",
    "interactions_to_tensor_dict",
    "is_interaction_dict",
    "tag_group_rows",
]
