"""Weights on their way from the trainer to the inference servers, one room per job:

- ``weight_sync``: ``WeightSynchronizer``, the one owner of pausing, pushing, verifying
  and committing versions (and of rolling back a refused sync);
- ``transports``: how the weights travel (disk, adapter-only, sharded, xccl), behind one
  interface (export -> push -> commit / rollback);
- ``weight_verify``: ``WeightFingerprintHook``, the check between push and commit;
- ``server_watchdog``: ``ServerWatchdog``, restarting dead or hung servers and
  readmitting them with the current weights;
- ``fingerprint``: the digests both sides compute of the weights (sampled per-tensor
  fingerprints, the reference file, their comparison);
- ``delta``: weight deltas (the base kept per version, encoding and applying a delta).

The engine side (exporting, pushing, fingerprinting an FSDP model) is in
``areal.engine.fsdp``; the server side (loading, checking, committing) in
``areal.inference.server``; the client's weight RPCs in ``areal.inference.remote.weights``;
the contract between them in ``areal.api.weights_api``.

The old paths ``areal.infra.weight_sync``, ``areal.infra.weight_verify`` and
``areal.infra.server_watchdog`` re-export their public names.
"""
