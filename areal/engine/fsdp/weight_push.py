"""Weight push parts of ``FSDPEngine``: the disk push (HF save, then the connected
inference engine reloads it) and the ``xccl`` broadcast (training rank 0 joins the
weight-update group and broadcasts the export's buckets in order).

These only move weights: pausing, verifying and versions belong to
``areal.infra.weights.weight_sync.WeightSynchronizer``, which calls ``update_weights`` for
``xccl`` (its transport) and ``save`` for disk.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import WeightUpdateMeta
from areal.utils import logging
from areal.utils.dist import broadcast_tensor, init_custom_process_group

logger = logging.getLogger("FSDPEngine")


def _wait(fut: Any, what: str, timeout: float | None = None) -> Any:
    if fut is None:
        return None
    if isinstance(fut, Future) or hasattr(fut, "result"):
        try:
            return fut.result(timeout=timeout)
        except Exception as e:  # re-raised with context
            raise RuntimeError(f"{what} failed: {e}") from e
    return fut


class FSDPWeightPushMixin:
    """``connect_engine`` / ``update_weights`` of ``FSDPEngine`` (module docstring)."""

    # ------------------------------------------------------------------ weight sync
    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        self.inference_engine = engine
        self.weight_update_meta = meta

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the current weights (``disk`` or ``xccl``, see ``areal.api.io_struct``).

        Collective: every training rank calls it; rank 0 talks to the inference engine.
        Moves weights only: the version is set by ``WeightSynchronizer`` at commit.
        """
        if meta.type == "disk":
            self._update_weights_from_disk(meta)
        elif meta.type == "xccl":
            self._update_weights_from_distributed(meta)
        else:
            raise ValueError(f"WeightUpdateMeta.type={meta.type!r}; allowed: 'disk', 'xccl'")

    def _update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        if not meta.path:
            raise ValueError("WeightUpdateMeta.path is required for a disk weight update")
        t0 = time.perf_counter()
        if getattr(meta, "use_lora", False):
            if self._lora_scale is None:
                raise ValueError("WeightUpdateMeta.use_lora=True but the model has no LoRA adapter")
            self.save_lora_adapter(meta.path)  # adapter only
        else:
            self._save_hf(meta.path)
        if dist.get_rank() == 0 and self.inference_engine is not None:
            fut = self.inference_engine.update_weights_from_disk(meta)
            _wait(fut, "inference_engine.update_weights_from_disk")
        dist.barrier(group=self.data_parallel_group)
        logger.info("disk weight update to %s done in %.2fs", meta.path, time.perf_counter() - t0)

    def _ensure_weight_update_group(self, meta: WeightUpdateMeta) -> None:
        key = (meta.master_address, meta.master_port, meta.group_name, meta.world_size)
        if self._weight_update_group is not None and self._weight_update_group_key == key:
            return
        if meta.world_size < 2:
            raise ValueError(
                f"WeightUpdateMeta.world_size={meta.world_size}; xccl needs 1 trainer + >= 1 "
                "inference worker (set it before update_weights)"
            )
        if not meta.master_port:
            raise ValueError("WeightUpdateMeta.master_port must be set for an xccl weight update")
        backend = meta.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        fut = None
        if self.inference_engine is not None:
            fut = self.inference_engine.init_weights_update_group(meta)
        self._weight_update_group = init_custom_process_group(
            backend,
            meta.master_address,
            meta.master_port,
            meta.world_size,
            rank=0,
            group_name=meta.group_name,
            timeout_s=meta.timeout_s,
        )
        self._weight_update_group_key = key
        _wait(fut, "inference_engine.init_weights_update_group")
        logger.info(
            "joined weight-update group %s (%s, world_size=%d) at %s:%d",
            meta.group_name,
            backend,
            meta.world_size,
            meta.master_address,
            meta.master_port,
        )

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        """``xccl``: training rank 0 joins the weight-update group (group rank 0, hosts the
        ``TCPStore``); other ranks return at once. A rendezvous: the inference servers must
        be joining at the same time (``InferenceEngine.init_weights_update_group``). Done
        lazily by the first ``update_weights`` when not called before."""
        if meta.type != "xccl":
            raise ValueError(f"init_weights_update_group needs type='xccl', got {meta.type!r}")
        if dist.get_rank() == 0:
            self._ensure_weight_update_group(meta)

    def _update_weights_from_distributed(self, meta: WeightUpdateMeta) -> None:
        t0 = time.perf_counter()
        rank0 = dist.get_rank() == 0
        if rank0:
            self._ensure_weight_update_group(meta)
        limit = int(meta.weight_chunked_mem_mb) << 20
        for bucket, tensors in self._gather_buckets(limit):
            if rank0:
                fut = None
                if self.inference_engine is not None:
                    fut = self.inference_engine.update_weights_from_distributed(meta, bucket)
                for t in tensors:
                    broadcast_tensor(self._weight_update_group, t, root=0)
                _wait(fut, "inference_engine.update_weights_from_distributed")
            del tensors
        dist.barrier(group=self.data_parallel_group)
        logger.info("xccl weight update done in %.2fs", time.perf_counter() - t0)
