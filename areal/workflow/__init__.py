"""Rollout workflows: how one data item becomes trajectories.

Import the concrete workflows from their modules (``areal.workflow.rlvr.RLVRWorkflow``,
``areal.workflow.grouped.GroupedRolloutWorkflow``); this package import stays light.
"""
