"""Rollout: the workflow executor and what it uses.

- ``workflow_executor``: ``WorkflowExecutor``, with ``rollout_submission``,
  ``rollout_results`` and ``failure_monitor`` (stops a run whose episodes keep failing);
- ``staleness_manager``, ``generation_bound``, ``async_task_runner``: admission and the
  off-policy bound.

The client of inference servers (``RemoteInfEngine``) is in ``areal.inference.remote``.
"""
