"""Weight export of ``FSDPEngine`` (``areal.api.weights_api.WeightExporter``): the
exported tensors by Hugging Face name (LoRA merged), their specs and buckets, the full
tensors gathered bucket by bucket, the LoRA adapter alone, and one share of the tensors
per rank (``export_weight_shards``, the sharded transport).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from areal.api.io_struct import ParamSpec
from areal.engine.fsdp.checkpoint import write_safetensors
from areal.utils import logging

logger = logging.getLogger("FSDPEngine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bucket_param_specs(specs: list[ParamSpec], limit_bytes: int) -> list[list[ParamSpec]]:
    """Group specs, in order, into buckets of at most ``limit_bytes`` (a larger tensor gets
    a bucket of its own)."""
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes={limit_bytes}; must be > 0")
    buckets: list[list[ParamSpec]] = []
    cur: list[ParamSpec] = []
    cur_bytes = 0
    for spec in specs:
        nbytes = spec.size_bytes
        if cur and cur_bytes + nbytes > limit_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(spec)
        cur_bytes += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class FSDPWeightExportMixin:
    """What ``FSDPEngine`` exports to the inference servers (module docstring)."""

    # ------------------------------------------------------------------ state dicts
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict on rank 0, ``{}`` elsewhere. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            self._require_model(), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self._tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    def _export_dtype(self) -> torch.dtype:
        name = self.config.dtype or "float32"
        return DTYPES.get(name, torch.float32) if self.device.type == "cuda" else torch.float32

    def _gather_buckets(self, limit_bytes: int, digest_pool: Any = None, defer: bool = False):
        """Yield ``(specs, full_tensors)`` bucket by bucket (export dtype, contiguous).

        Collective: every rank iterates (each ``full_tensor`` is an all-gather); the
        tensors are full on every rank. Order: ``named_parameters`` (tied weights once),
        then persistent buffers. ``digest_pool`` (a one-thread executor): the weight
        fingerprint digests run there, alongside what the caller does with each bucket
        (e.g. writing it), and are waited for at the end. ``defer``: they are not taken;
        the tensors are kept (``self._export_held``) for ``_finish_reference``.
        """
        from areal.infra.weights.fingerprint import WeightDigests, rotation_share

        self._join_deferred_digests()  # the last export's digests read those tensors
        dt = self._export_dtype()
        named = self._export_tensors()
        # verified weight sync (enable_weight_fingerprints): digests taken while each
        # tensor is at hand (rank 0), in full for this check's rotation share
        self._export_digests = digests = None
        every = getattr(self, "_fingerprint_every", 0)
        if every:
            sizes = getattr(self, "_fingerprint_sizes", None)
            if sizes is None or len(sizes) != len(named):  # the model's names and sizes
                sizes = self._fingerprint_sizes = [(n, t.numel()) for n, t in named.items()]
            share = rotation_share(sizes, every, self._fingerprint_checks)
            digests = WeightDigests(
                dist.get_rank() == 0,
                share,
                self._fingerprint_dtypes,
                getattr(self, "_fingerprint_views", None),
            )
        pending = []
        held: list[tuple[str, torch.Tensor]] | None = [] if defer else None
        self._export_held = None
        for bucket in bucket_param_specs(self._export_specs(named), limit_bytes):
            tensors = []
            for spec in bucket:
                t = named[spec.name].detach()
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                tensors.append(full.to(dt).contiguous())
                if digests is not None and not hasattr(self, "_fingerprint_views"):
                    # exports that are the live parameters themselves (one CPU rank, no
                    # cast): the digests keep their sampled positions across exports
                    local = t.to_local() if hasattr(t, "to_local") else t
                    alias = tensors[-1].data_ptr() == local.data_ptr()
                    self._fingerprint_views = {} if alias else None
                    digests._views = self._fingerprint_views
            if digests is not None and digests.enabled:
                items = list(zip((spec.name for spec in bucket), tensors))
                if held is not None:
                    held.extend(items)
                elif digest_pool is not None:
                    pending.append(digest_pool.submit(digests.add, items))
                else:
                    digests.add(items)
            yield bucket, tensors
        for f in pending:
            f.result()
        if digests is not None:
            digests.complete = held is None
            self._export_held = held if digests.enabled else None
        self._export_digests = digests

    def _export_tensors(self) -> dict[str, torch.Tensor]:
        """Exported tensors by HF name (sharded DTensors for parameters): parameters in
        ``named_parameters`` order (tied weights once, so a tied ``lm_head.weight`` is left
        out), then persistent buffers."""
        model = self._require_model()
        named: dict[str, torch.Tensor] = dict(model.named_parameters())
        sd_keys = set(model.state_dict().keys())
        for name, buf in model.named_buffers():
            if name in sd_keys and name not in named:
                named[name] = buf
        if self._lora_scale is not None:
            from areal.engine.lora import merged_export_tensors

            # HF names, adapter merged into the targeted weights (W0 + s * B @ A)
            return merged_export_tensors(named, self._lora_scale)
        return named

    def save_lora_adapter(self, path: str) -> int:
        """Write only the LoRA adapter (peft layout) to ``path`` on rank 0; collective.
        Returns the adapter's bytes (0 on other ranks)."""
        from areal.models.lora_adapter import adapter_tensors, write_adapter

        self._export_digests = None  # the merged weights were not exported this time
        named = adapter_tensors(dict(self._require_model().named_parameters()))
        full = {
            k: (v.detach().full_tensor() if hasattr(v, "full_tensor") else v.detach()).to(
                self._export_dtype()
            )
            for k, v in named.items()
        }
        n = 0
        if dist.get_rank() == 0:
            targets = sorted(
                {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in full if ".lora_A." in k}
            )
            n = write_adapter(path, full, self.config.lora_rank, self.config.lora_alpha, targets)
        dist.barrier(group=self.data_parallel_group)
        return n

    def _export_specs(self, named: dict[str, torch.Tensor]) -> list[ParamSpec]:
        dt_name = str(self._export_dtype()).removeprefix("torch.")
        return [ParamSpec(n, tuple(int(x) for x in t.shape), dt_name) for n, t in named.items()]

    def get_param_specs(self, weight_chunked_mem_mb: int = 1024) -> list[list[ParamSpec]]:
        """Export specs (full shapes, export dtype) in ``named_parameters`` order, bucketed
        so each bucket holds at most ``weight_chunked_mem_mb`` MiB (a larger tensor gets a
        bucket of its own)."""
        if weight_chunked_mem_mb <= 0:
            raise ValueError(f"weight_chunked_mem_mb={weight_chunked_mem_mb}; must be > 0")
        specs = self._export_specs(self._export_tensors())
        return bucket_param_specs(specs, int(weight_chunked_mem_mb) << 20)

    def export_weight_shards(self, path: str, shard_mb: int = 128) -> int:
        """The sharded export (``areal.api.weights_api``): the exported tensors gathered
        bucket by bucket (``shard_mb`` MiB each, collective) and bucket ``i`` written by
        rank ``i % world_size`` as ``model-rank{r}-{i:05d}.safetensors`` in ``path``, so
        the files are disjoint and together hold every tensor once (rank 0 also writes
        the config). Returns the bytes this rank wrote."""
        rank, world = dist.get_rank(), dist.get_world_size()
        os.makedirs(path, exist_ok=True)
        if rank == 0:
            for f in os.listdir(path):  # an earlier export's shards
                if f.endswith(".safetensors"):
                    os.remove(os.path.join(path, f))
        dist.barrier(group=self.data_parallel_group)
        written = 0
        limit = max(1, int(shard_mb)) << 20
        for i, (specs, tensors) in enumerate(self._gather_buckets(limit)):
            if i % world != rank:
                continue
            named = {sp.name: t for sp, t in zip(specs, tensors)}
            write_safetensors(named, os.path.join(path, f"model-rank{rank}-{i:05d}.safetensors"))
            written += sum(t.numel() * t.element_size() for t in tensors)
        if rank == 0:
            cfg = self.model_config
            cfg.use_cache = True
            cfg.save_pretrained(path)
            cfg.use_cache = False
        dist.barrier(group=self.data_parallel_group)
        return written
