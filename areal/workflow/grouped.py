"""Re-export of :class:`areal.infra.grouped_workflow.GroupedRolloutWorkflow` (its old path)."""

from areal.infra.grouped_workflow import (
    GroupedRolloutWorkflow,
    interactions_to_tensor_dict,
    is_interaction_dict,
)

__all__ = ["GroupedRolloutWorkflow", "interactions_to_tensor_dict", "is_interaction_dict"]
