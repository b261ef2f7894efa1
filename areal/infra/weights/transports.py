"""Weight transports: how trained weights travel to the inference servers.

Each transport is a small object behind one interface, driven by ``WeightSynchronizer``
(``areal.infra.weights.weight_sync``) in this order::

    export    the trainer makes the weights available (a Hugging Face directory, an
              adapter, one shard per rank, or nothing: xccl streams them in ``push``)
    push      every server in rotation loads them under the *pending* version
              ``ctx.version``; ``/get_version`` still answers the previous one
    (verify)  the synchronizer's hooks check what the servers hold
    commit    every server makes the pending weights current as ``ctx.version``
    rollback  (instead of commit) every server serves the previous weights again

No transport pauses generation or sets a version on the trainer: both belong to the
synchronizer. What the trainer side must offer is ``areal.api.weights_api.WeightExporter``
(``FSDPEngine`` and ``TrainController`` do; a second training engine implements the same).

- ``DiskTransport``: ``actor.save(hf)`` into ``meta.path``, servers reload it.
- ``AdapterTransport``: LoRA: only the adapter is written (``actor.save_lora_adapter``),
  servers merge it into their base weights.
- ``XcclTransport``: ``actor.update_weights(meta)``: training rank 0 broadcasts bucket by
  bucket while the controller announces each bucket to the servers.
- ``ShardedDiskTransport``: every training rank writes its own share of the tensors
  (``actor.export_weight_shards``), servers load the directory (the parallel engine's
  export, where no rank holds the whole model).

``transport_for(meta)`` picks one from a ``WeightUpdateMeta``.
"""

from __future__ import annotations

import os
from typing import Any

from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal.utils import logging

logger = logging.getLogger("WeightTransport")


def resolve(result: Any, what: str) -> Any:
    """The value of ``result`` (a ``concurrent.futures.Future`` or a plain value)."""
    if result is not None and hasattr(result, "result"):
        return result.result()
    return result


class WeightTransport:
    """One way of moving weights (module docstring). ``ctx`` is the synchronizer's
    ``WeightSyncContext`` (``actor``, ``rollout``, ``meta``, ``version``,
    ``previous_version``)."""

    name = "base"

    def export(self, ctx: Any) -> None:
        """Trainer side, before any server is touched (collective on the actor)."""

    def push(self, ctx: Any) -> None:
        """Every server in rotation loads the weights as pending ``ctx.version``; raises
        when one of them fails (the synchronizer then rolls all of them back)."""
        raise NotImplementedError

    def commit(self, ctx: Any) -> None:
        """The pending weights become current as ``ctx.version`` on every server."""
        ctx.rollout.commit_weights(ctx.version)

    def rollback(self, ctx: Any, previous_path: str | None) -> list[str]:
        """Every server serves the weights it had before ``push`` again, at
        ``ctx.previous_version``; ``previous_path``: a directory holding them, for servers
        that cannot restore their own copy (None: the initial model). Returns the servers
        that could not be rolled back (taken out of rotation: the watchdog readmits them
        with the current weights)."""
        return list(ctx.rollout.rollback_weights(previous_path) or [])


class DiskTransport(WeightTransport):
    """Safetensors directory per version; servers reload it."""

    name = "disk"

    def export(self, ctx: Any) -> None:
        if not ctx.meta.path:
            raise ValueError("WeightUpdateMeta.path is required for a disk weight update")
        ctx.actor.save(SaveLoadMeta(path=ctx.meta.path, weight_format="hf", with_optim=False))

    def push(self, ctx: Any) -> None:
        resolve(ctx.rollout.update_weights_from_disk(ctx.meta), "update_weights_from_disk")


class AdapterTransport(DiskTransport):
    """LoRA: only the adapter (peft layout) is written; servers merge it in."""

    name = "adapter"

    def export(self, ctx: Any) -> None:
        if not ctx.meta.path:
            raise ValueError("WeightUpdateMeta.path is required for an adapter weight update")
        ctx.actor.save_lora_adapter(ctx.meta.path)


class ShardedDiskTransport(DiskTransport):
    """Every training rank writes its own share of the tensors into ``meta.path``."""

    name = "sharded"

    def export(self, ctx: Any) -> None:
        if not ctx.meta.path:
            raise ValueError("WeightUpdateMeta.path is required for a sharded weight update")
        os.makedirs(ctx.meta.path, exist_ok=True)
        ctx.actor.export_weight_shards(ctx.meta.path)


class XcclTransport(WeightTransport):
    """Broadcast over the weight-update process group (gloo on CPU, NCCL on GPU)."""

    name = "xccl"

    def push(self, ctx: Any) -> None:
        ctx.actor.update_weights(ctx.meta)


def transport_for(meta: WeightUpdateMeta) -> WeightTransport:
    """The transport of ``meta``: ``xccl``; ``disk`` (``use_lora``: adapter only;
    ``sharded``: one share per training rank)."""
    if meta.type == "xccl":
        return XcclTransport()
    if meta.type == "disk":
        if meta.use_lora:
            return AdapterTransport()
        if meta.sharded:
            return ShardedDiskTransport()
        return DiskTransport()
    raise ValueError(f"WeightUpdateMeta.type={meta.type!r}; allowed: 'disk', 'xccl'")
