"""``BatchRef``: the controller's handle of a batch held on one role's workers.

Made by ``TrainController.put_batch(batch)``, which sends each worker its data-parallel
shard once (``areal.infra.rpc.batch_store``). Pass the ref wherever a batch goes::

    ref = actor.put_batch(batch)                      # the batch crosses once
    actor.compute_logp(ref, _store_as="prox_logp")    # stays on the workers
    ref.update({"ref_logp": ref_logp})                # a [B, T] tensor the actor needs
    ref = actor.compute_advantages(ref)               # in place on the workers
    stats = actor.ppo_update(ref)                     # only the stats come back
    ref.free()                                        # every step (or ``with ref:``)

Per-row values given to ``update`` are split like the batch; ``fetch`` and results of
calls on the ref come back merged in the original row order. For code written against
plain dicts, a ref also reads like one (``keys()``, ``ref["key"]``, ``get``, ``items()``,
``to_dict()``): each read fetches what it names from the workers, so it costs a transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from areal.infra.rpc.batch_store import STORE_ENGINE, StoredBatch


class BatchRef:
    """A batch of ``batch_size`` rows held on ``controller``'s workers (a
    ``TrainController``), split by ``indices`` (per data-parallel rank, original row
    numbers)."""

    def __init__(
        self,
        controller: Any,
        ref_id: str,
        indices: list[torch.Tensor],
        batch_size: int,
    ):
        self.controller = controller
        self.ref_id = ref_id
        self.indices = indices
        self.batch_size = batch_size
        self.freed = False

    def __repr__(self) -> str:
        role = self.controller.role
        return f"BatchRef({self.ref_id!r}, role={role!r}, rows={self.batch_size})"

    def handle(self, store_as: str | None = None) -> StoredBatch:
        if self.freed:
            raise RuntimeError(f"{self!r} was freed")
        return StoredBatch(self.ref_id, store_as)

    def _rank_slices(self, entries: dict[str, Any]) -> list[tuple[tuple, dict]]:
        """Per worker: ``entries`` with per-row tensors cut to that worker's rows."""
        out = []
        for dp in self.controller.dp_ranks:
            idx = self.indices[dp]
            part = {
                k: v[idx]
                if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == self.batch_size
                else v
                for k, v in entries.items()
            }
            out.append(((self.ref_id, part), {}))
        return out

    def update(self, entries: dict[str, Any]) -> None:
        """Add entries on the workers (per-row tensors split like the batch)."""
        self.handle()
        self.controller._call_all("update", self._rank_slices(entries), engine_name=STORE_ENGINE)

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    # ---------------------------------------------------------- dict-like reads
    def keys(self) -> list[str]:
        """The entries the workers hold now (asked of the first worker)."""
        self.handle()
        c = self.controller
        return c.scheduler.call_engine(
            c.workers[0].id, "keys", self.ref_id, engine_name=STORE_ENGINE, timeout=c.call_timeout
        )

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def __getitem__(self, key: str) -> Any:
        out = self.fetch([key])
        if key not in out:
            raise KeyError(f"{key!r} not in {self!r}")
        return out[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fetch([key]).get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """The whole batch, fetched back (per-row entries in the original order)."""
        return self.fetch(self.keys())

    def items(self):
        return self.to_dict().items()

    def fetch(self, keys: list[str]) -> dict[str, Any]:
        """The named entries, per-row tensors merged in the original row order."""
        self.handle()
        results = self.controller._call_all(
            "fetch",
            [((self.ref_id, list(keys)), {})] * len(self.controller.workers),
            engine_name=STORE_ENGINE,
        )
        return self.controller.merge_results(results, self.indices)

    def apply(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """``fn(shard, *args, **kwargs)`` on every data-parallel rank's shard (``fn`` an
        importable module-level function); the results in data-parallel rank order."""
        results = self.controller._call_all(
            "apply",
            [((self.ref_id, fn, *args), kwargs)] * len(self.controller.workers),
            engine_name=STORE_ENGINE,
        )
        return self.controller.head_results(results)

    def free(self) -> None:
        """Drop the batch on every worker (again: no-op)."""
        if self.freed or not self.controller.workers:
            self.freed = True
            return
        self.freed = True
        self.controller._call_all(
            "free", [((self.ref_id,), {})] * len(self.controller.workers), engine_name=STORE_ENGINE
        )

    def __enter__(self) -> BatchRef:
        return self

    def __exit__(self, *exc) -> None:
        self.free()
