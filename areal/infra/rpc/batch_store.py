"""Batches held by an RPC worker between calls, so the controller ships a batch once per step.

The controller puts a data-parallel shard of the step's batch on each worker
(``BatchStore.put``) and from then on sends only a :class:`StoredBatch` handle, a few
dozen bytes, in place of the batch (in the spirit of AReaL's ``RTensor``: the tensors
stay where they are used, the controller holds references). The worker's ``EngineHost``
resolves handles before calling the engine:

- every argument that is a ``StoredBatch`` becomes the stored dict itself (so in-place
  updates such as ``compute_advantages`` writing ``data["advantages"]`` persist);
- the result: a padded batch (a dict with a 2-D ``attention_mask``) replaces the stored
  dict and the handle goes back instead of the tensors; with ``store_as="key"`` on the
  handle, the result is stored under that key and ``None`` goes back; anything else (stats,
  small tensors) is returned as it is.

Host methods (called with ``engine_name=STORE_ENGINE``): ``put``, ``update``, ``fetch``,
``keys``, ``apply``, ``free``, ``info``. A handle that names a freed or unknown batch raises
``KeyError`` naming it. The controller frees every batch at the end of its step
(``areal.infra.controller.batch_ref.BatchRef.free``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

#: ``engine_name`` under which a worker's ``BatchStore`` answers RPC calls.
STORE_ENGINE = "__batch_store__"


@dataclass(frozen=True)
class StoredBatch:
    """Handle of a batch held by the worker that receives it (pickled into RPC calls).

    ``store_as``: the result of the call is stored under this key of the batch instead
    of being returned."""

    ref_id: str
    store_as: str | None = None

    def storing(self, key: str | None) -> StoredBatch:
        return replace(self, store_as=key)


def _is_padded_batch(x: Any) -> bool:
    mask = x.get("attention_mask") if isinstance(x, dict) else None
    return isinstance(mask, torch.Tensor) and mask.ndim == 2


def _nbytes(batch: dict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


class BatchStore:
    """The batches of one worker, by reference id (thread-safe; tiny dicts of tensors)."""

    def __init__(self):
        self._batches: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ host methods
    def put(self, ref_id: str, batch: dict[str, Any]) -> None:
        if not isinstance(batch, dict):
            raise TypeError(f"put({ref_id!r}): a batch is a dict, got {type(batch).__name__}")
        with self._lock:
            self._batches[ref_id] = batch

    def update(self, ref_id: str, entries: dict[str, Any]) -> None:
        """Add or replace entries (e.g. ``ref_logp`` computed by another role)."""
        self.get(ref_id).update(entries)

    def fetch(self, ref_id: str, keys: list[str]) -> dict[str, Any]:
        """The named entries (missing keys are left out)."""
        batch = self.get(ref_id)
        return {k: batch[k] for k in keys if k in batch}

    def keys(self, ref_id: str) -> list[str]:
        return list(self.get(ref_id))

    def apply(self, ref_id: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(batch, *args, **kwargs)`` on the stored batch; ``fn`` must be an importable
        module-level function (it travels by reference). For small reductions."""
        return fn(self.get(ref_id), *args, **kwargs)

    def free(self, ref_id: str) -> bool:
        """Drop the batch; ``False`` when it was not held (freeing twice is harmless)."""
        with self._lock:
            return self._batches.pop(ref_id, None) is not None

    def info(self) -> dict[str, Any]:
        """``{"n_batches", "bytes", "ref_ids"}`` of what is held now."""
        with self._lock:
            return {
                "n_batches": len(self._batches),
                "bytes": sum(_nbytes(b) for b in self._batches.values()),
                "ref_ids": sorted(self._batches),
            }

    # ------------------------------------------------------------------ resolution
    def get(self, ref_id: str) -> dict[str, Any]:
        with self._lock:
            batch = self._batches.get(ref_id)
        if batch is None:
            raise KeyError(
                f"no stored batch {ref_id!r} on this worker (freed, or put on another worker)"
            )
        return batch

    def resolve_args(self, args: Any, kwargs: Any) -> tuple[Any, Any, StoredBatch | None]:
        """Arguments with handles replaced by their batches, and the first handle (or None)."""
        handle = None

        def one(x):
            nonlocal handle
            if isinstance(x, StoredBatch):
                handle = handle or x
                return self.get(x.ref_id)
            return x

        if isinstance(args, list | tuple):
            args = type(args)(one(a) for a in args)
        if isinstance(kwargs, dict):
            kwargs = {k: one(v) for k, v in kwargs.items()}
        return args, kwargs, handle

    def keep_result(self, handle: StoredBatch, result: Any) -> Any:
        """What goes back for a call made on ``handle`` (module doc)."""
        if handle.store_as is not None:
            self.get(handle.ref_id)[handle.store_as] = result
            return None
        if _is_padded_batch(result):
            batch = self.get(handle.ref_id)
            if result is not batch:
                batch.clear()
                batch.update(result)
            return replace(handle, store_as=None)
        return result
