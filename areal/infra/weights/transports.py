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
- ``DeltaTransport`` (``meta.delta``): only the elements that changed since the servers'
  committed version (``actor.export_weight_delta``, ``areal.infra.weights.delta``), applied
  by built-in servers as a pending update; a full disk sync (the anchor) first, every
  ``meta.delta_anchor_interval`` committed deltas, after a rolled-back delta, and always
  when a server has no delta route (vLLM, SGLang).

``transport_for(meta)`` picks one from a ``WeightUpdateMeta``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal.utils import logging, stats_tracker

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


_NO_DELTA_LOGGED: set[str] = set()


class DeltaTransport(DiskTransport):
    """Sparse deltas against the servers' committed version, with full "anchor" syncs
    (module docstring). Decides at ``export``: a full sync when the servers do not all
    apply deltas, when the trainer keeps no base of the servers' version
    (``actor.weight_delta_state()``: the first sync, a rolled-back delta), or when
    ``meta.delta_anchor_interval`` deltas were committed since the last full one. The
    state lives with the trainer (its kept base), so a transport per sync is enough.

    Stats: ``weight_sync/delta`` (1: a delta was sent, 0: a full sync),
    ``weight_sync/delta_anchor`` (1: full because of the anchor interval),
    ``weight_sync/delta_bytes`` (the delta's files), ``weight_sync/delta_dense_bytes`` (the
    same weights in full, in the servers' dtype), ``weight_sync/delta_changed_fraction``.
    """

    name = "delta"

    def __init__(self) -> None:
        self.full = True

    def _why_full(self, ctx: Any) -> str | None:
        rollout, meta = ctx.rollout, ctx.meta
        supports = getattr(rollout, "supports_weight_delta", None)
        if not callable(supports) or not supports():
            backend = getattr(getattr(rollout, "backend", None), "name", type(rollout).__name__)
            if backend not in _NO_DELTA_LOGGED:
                _NO_DELTA_LOGGED.add(backend)
                logger.warning(
                    "delta weight transfer is not available for the %r inference backend "
                    "(no delta route): every weight sync is a full disk sync",
                    backend,
                )
            return "backend"
        if not callable(getattr(ctx.actor, "weight_delta_state", None)):
            name = type(ctx.actor).__name__
            if name not in _NO_DELTA_LOGGED:
                _NO_DELTA_LOGGED.add(name)
                logger.warning(
                    "%s has no delta export (weight_delta_state / export_weight_delta): "
                    "every weight sync is a full disk sync",
                    name,
                )
            return "backend"
        state = ctx.actor.weight_delta_state()
        if state.get("version") is None:
            return "first"
        if state.get("full_next"):
            return "rolled back"
        if state.get("version") != ctx.previous_version or state.get("dtype") != meta.delta_dtype:
            return "base"
        if meta.delta_anchor_interval and state.get("deltas", 0) >= meta.delta_anchor_interval:
            return "anchor"
        return None

    def export(self, ctx: Any) -> None:
        if not ctx.meta.path:
            raise ValueError("WeightUpdateMeta.path is required for a delta weight update")
        why = self._why_full(ctx)
        self.full = why is not None
        ctx.stats["weight_sync/delta"] = 0.0 if self.full else 1.0
        ctx.stats["weight_sync/delta_anchor"] = 1.0 if why == "anchor" else 0.0
        if self.full:
            super().export(ctx)
            if why != "backend":  # the next delta's base: what was just sent
                ctx.actor.export_weight_delta(None, None, ctx.version, ctx.meta.delta_dtype)
            logger.info("weights of version %d sent in full (%s)", ctx.version, why)
            return
        manifest = ctx.actor.export_weight_delta(
            ctx.meta.path, ctx.previous_version, ctx.version, ctx.meta.delta_dtype
        )
        totals = (manifest or {}).get("totals") or {}
        ctx.stats["weight_sync/delta_bytes"] = float(totals.get("bytes", 0))
        ctx.stats["weight_sync/delta_dense_bytes"] = float(totals.get("dense_bytes", 0))
        numel = float(totals.get("numel", 0)) or 1.0
        ctx.stats["weight_sync/delta_changed_fraction"] = float(totals.get("changed", 0)) / numel

    def _record(self, ctx: Any) -> None:
        """The sync's delta stats into ``stats_tracker`` too (the trainer's step row)."""
        keys = ("delta", "delta_anchor", "delta_bytes", "delta_dense_bytes")
        keys += ("delta_changed_fraction",)
        stats_tracker.scalar(
            **{
                f"weight_sync/{k}": ctx.stats[f"weight_sync/{k}"]
                for k in keys
                if f"weight_sync/{k}" in ctx.stats
            }
        )

    def push(self, ctx: Any) -> None:
        if self.full:
            super().push(ctx)
        else:
            resolve(ctx.rollout.update_weights_from_delta(ctx.meta), "update_weights_from_delta")

    def commit(self, ctx: Any) -> None:
        super().commit(ctx)
        if callable(getattr(ctx.actor, "commit_weight_delta", None)):
            ctx.actor.commit_weight_delta(ctx.version, True)
        self._record(ctx)

    def rollback(self, ctx: Any, previous_path: str | None) -> list[str]:
        try:
            return super().rollback(ctx, previous_path)
        finally:  # the base stays at the servers' version; after a delta, a full sync next
            if callable(getattr(ctx.actor, "commit_weight_delta", None)):
                ctx.actor.commit_weight_delta(ctx.version, False)


class XcclTransport(WeightTransport):
    """Broadcast over the weight-update process group (gloo on CPU, NCCL on GPU)."""

    name = "xccl"

    def push(self, ctx: Any) -> None:
        ctx.actor.update_weights(ctx.meta)


def with_delta(meta: WeightUpdateMeta, actor_config: Any) -> WeightUpdateMeta:
    """``meta`` with delta transfer as ``actor_config`` asks
    (``enable_delta_weight_update``, ``weight_update_anchor_interval``; the servers'
    dtype: the actor's ``dtype``, which built-in servers are started with). Delta needs
    the ``disk`` mode and no LoRA: otherwise the full transfer of ``meta`` is kept and
    that is logged once."""
    if not actor_config.enable_delta_weight_update:
        return meta
    why = None
    if meta.type != "disk":
        why = f"weight_update_mode={meta.type!r} (delta needs 'disk'): full {meta.type} broadcasts"
    elif actor_config.use_lora:
        why = "use_lora=True: adapter-only updates"
    if why is not None:
        if why not in _NO_DELTA_LOGGED:
            _NO_DELTA_LOGGED.add(why)
            logger.warning("actor.enable_delta_weight_update is not used with %s", why)
        return meta
    dtype = actor_config.dtype if actor_config.dtype in ("float16", "float32") else "bfloat16"
    return dataclasses.replace(
        meta,
        delta=True,
        delta_dtype=dtype,
        delta_anchor_interval=int(actor_config.weight_update_anchor_interval),
    )


def transport_for(meta: WeightUpdateMeta) -> WeightTransport:
    """The transport of ``meta``: ``xccl``; ``disk`` (``use_lora``: adapter only;
    ``sharded``: one share per training rank; ``delta``: changed elements only)."""
    if meta.type == "xccl":
        return XcclTransport()
    if meta.type == "disk":
        if meta.use_lora:
            return AdapterTransport()
        if meta.sharded:
            return ShardedDiskTransport()
        if meta.delta:
            return DeltaTransport()
        return DiskTransport()
    raise ValueError(f"WeightUpdateMeta.type={meta.type!r}; allowed: 'disk', 'xccl'")
