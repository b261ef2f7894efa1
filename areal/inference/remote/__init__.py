"""``RemoteInfEngine`` (``engine``), the protocol-agnostic client of inference servers,
assembled from ``http`` (HTTP plumbing), ``server_rotation`` (health deadlines and the
rotation of servers), ``server_launch`` (starting servers through a scheduler) and
``weights`` (the weight-update RPCs). The types it shares with the backend adapters are in
``areal.api.inference_protocol``."""
