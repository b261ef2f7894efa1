"""Weights on their way from the trainer to the inference servers, one room per job:

- ``weight_sync``: ``WeightSynchronizer``, the one owner of pausing, pushing, verifying
  and committing versions (and of rolling back a refused sync);
- ``transports``: how the weights travel (disk, adapter-only, sharded, xccl), behind one
  interface (export -> push -> commit / rollback);
- ``weight_verify``: ``WeightFingerprintHook``, the check between push and commit;
- ``server_watchdog``: ``ServerWatchdog``, restarting dead or hung servers and
  readmitting them with the current weights.

The old paths ``areal.infra.weight_sync``, ``areal.infra.weight_verify`` and
``areal.infra.server_watchdog`` re-export their public names.
"""
