"""Rollout: the remote inference client, the workflow executor and what it uses.

- ``remote_inf_engine``: ``RemoteInfEngine``, the protocol-agnostic client of inference
  servers, assembled from ``remote_http`` (HTTP plumbing), ``server_rotation`` (health
  deadlines and the rotation of servers), ``server_launch`` (starting servers) and
  ``remote_weights`` (the weight-update RPCs); the types it shares with the backend
  adapters are in ``areal.api.inference_protocol``;
- ``workflow_executor``: ``WorkflowExecutor``, with ``rollout_submission``,
  ``rollout_results`` and ``failure_monitor`` (stops a run whose episodes keep failing).
"""
