"""Checkpoints of ``FSDPEngine``: Hugging Face directories (full weights gathered bucket
by bucket, rank 0 writing each safetensors shard on a thread while the next is gathered)
and DCP (sharded model, optimizer and LR scheduler for an exact resume), synchronous or
asynchronous (``SaveLoadMeta.save_mode``: the state is copied to CPU memory by
``torch.distributed.checkpoint.async_save`` and written by a background thread over a
gloo group of its own while training continues; ``wait_async_save`` finishes it, and the
next save, a load and ``destroy`` wait for it first).

``FSDPCheckpointMixin`` holds ``save`` / ``load``; ``write_safetensors`` writes one shard
straight from the tensors' memory.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from areal.api.io_struct import SaveLoadMeta
from areal.utils import logging

logger = logging.getLogger("FSDPEngine")

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None
) -> None:
    """Write CPU tensors as a safetensors file straight from their memory (no staging copy).

    Same format as ``safetensors.torch.save_file`` (8-byte header length, JSON header,
    raw little-endian data); readable by ``safe_open``/``load_file``/``from_pretrained``.
    """
    import json
    import struct

    header: dict[str, Any] = {}
    offset = 0
    flat = []
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype} that safetensors cannot store")
        t = t.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
        flat.append(t.reshape(-1).view(torch.uint8))
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in flat:
            if t.numel():
                f.write(t.numpy().data)


_SAFETENSORS_NAME = "model.safetensors"

_SAFETENSORS_INDEX = "model.safetensors.index.json"

_EXTRA_STATE_NAME = "engine_extra_state.pt"

# save_mode="auto": asynchronous from this much checkpoint state per rank (model +
# optimizer). Below it the write takes well under a second and the staging copy (as much
# CPU memory again) buys little.
AUTO_ASYNC_MIN_BYTES = 64 << 20


def _state_bytes(state: Any) -> int:
    """Bytes of the (local shards of the) tensors in a nested state dict."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


class FSDPCheckpointMixin:
    """``save`` / ``load`` of ``FSDPEngine`` (module docstring)."""

    def _save_hf(self, path: str, tokenizer: Any = None) -> None:
        """Gather bucket by bucket; rank 0 writes each safetensors shard in a background
        thread while the next bucket is gathered. One shard is named ``model.safetensors``;
        more get ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``."""
        import json
        from concurrent.futures import ThreadPoolExecutor

        from areal.infra.weights.fingerprint import REFERENCE_FILE

        rank0 = dist.get_rank() == 0
        t0 = time.perf_counter()
        if rank0:
            os.makedirs(path, exist_ok=True)
            for f in os.listdir(path):  # stale shards (and reference) of an earlier save
                if f.endswith(".safetensors") or f in (_SAFETENSORS_INDEX, REFERENCE_FILE):
                    os.remove(os.path.join(path, f))
        shard_bytes = max(1, int(self.hf_shard_mb * (1 << 20)))
        shards: list[tuple[str, list[str], int]] = []
        pool = ThreadPoolExecutor(max_workers=1) if rank0 else None
        # the fingerprint digests (verified weight sync): alongside the shard writes, or
        # deferred to a thread after the save (FSDPFingerprintMixin)
        digest_pool, defer = self._digest_plan(path) if rank0 else (None, False)
        futs = []
        try:
            buckets = self._gather_buckets(shard_bytes, digest_pool, defer)
            for i, (specs, tensors) in enumerate(buckets):
                if not rank0:
                    continue
                tmp_name = f"shard-{i:05d}.safetensors.tmp"
                names = [sp.name for sp in specs]
                shards.append((tmp_name, names, sum(t.numel() * t.element_size() for t in tensors)))
                futs.append(
                    pool.submit(
                        write_safetensors,
                        dict(zip(names, tensors)),
                        os.path.join(path, tmp_name),
                        {"format": "pt"},
                    )
                )
            for f in futs:
                f.result()
        finally:
            for p in (pool, digest_pool):
                if p is not None:
                    p.shutdown(wait=True)
        if rank0:
            n = len(shards)
            weight_map: dict[str, str] = {}
            for i, (tmp_name, names, _) in enumerate(shards):
                final = _SAFETENSORS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(os.path.join(path, tmp_name), os.path.join(path, final))
                weight_map.update(dict.fromkeys(names, final))
            if n > 1:
                index = {
                    "metadata": {"total_size": sum(b for *_, b in shards)},
                    "weight_map": weight_map,
                }
                with open(os.path.join(path, _SAFETENSORS_INDEX), "w") as f:
                    json.dump(index, f, indent=1, sort_keys=True)
            logger.debug("HF save to %s: %d shard(s) in %.2fs", path, n, time.perf_counter() - t0)
            cfg = self.model_config
            cfg.use_cache = True
            cfg.save_pretrained(path)
            cfg.use_cache = False
            gen = getattr(self._require_model(), "generation_config", None)
            if gen is not None and not self.is_critic:
                try:
                    gen.save_pretrained(path)
                except Exception as e:  # generation config is optional
                    logger.warning("generation_config not saved: %s", e)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            self._write_fingerprint_reference(path)
        dist.barrier(group=self.data_parallel_group)
        if self._lora_scale is not None:  # the merged weights above + the adapter itself
            self.save_lora_adapter(os.path.join(path, "lora_adapter"))

    def _load_hf(self, path: str) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        files = (
            sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if os.path.isdir(path)
            else []
        )
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path!r}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(os.path.join(path, f)))
        model = self._require_model()
        if self._tie_word_embeddings and "lm_head.weight" not in sd:
            emb_key = next((k for k in sd if k.endswith("embed_tokens.weight")), None)
            if emb_key is not None:
                sd["lm_head.weight"] = sd[emb_key]
        sd = {k: v.to(torch.float32) for k, v in sd.items()}
        set_model_state_dict(
            model, sd, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def _dcp_options(self) -> Any:
        """``StateDictOptions`` of the DCP model/optimizer state (None: torch's defaults)."""
        return None

    def _dcp_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model = self._require_model()
        if self.optimizer is not None:
            msd, osd = get_state_dict(model, self.optimizer, options=self._dcp_options())
            return msd, osd
        return get_model_state_dict(model), {}

    def save(self, meta: SaveLoadMeta) -> bool:
        """``hf``: full weights (+ config, tokenizer) written by rank 0. ``dcp``: sharded
        model (+ optimizer and LR scheduler with ``with_optim``) for exact resume.

        Returns ``True`` when the DCP write goes on in the background (``save_mode``
        ``async``, or ``auto`` with at least ``AUTO_ASYNC_MIN_BYTES`` of state): the files
        are complete only after :meth:`wait_async_save`. A save first waits for the
        previous pending write."""
        self.wait_async_save()
        if meta.weight_format == "hf":
            self._save_hf(meta.path, meta.tokenizer)
            return False
        import torch.distributed.checkpoint as dcp

        state = self._dcp_target(meta)
        os.makedirs(meta.path, exist_ok=True)
        background = meta.save_mode == "async" or (
            meta.save_mode == "auto" and _state_bytes(state) >= AUTO_ASYNC_MIN_BYTES
        )
        t0 = time.perf_counter()
        if background:
            # staged (copied to CPU memory) before async_save returns; the write uses a
            # gloo group of its own so its collectives never interleave with training's
            future = dcp.async_save(
                state, checkpoint_id=meta.path, process_group=self._async_ckpt_group()
            )
            self._pending_save = (future, meta.path, t0)
        else:
            dcp.save(state, checkpoint_id=meta.path)
        if dist.get_rank() == 0:
            extra = {"version": self._version}
            if meta.with_optim and self.lr_scheduler is not None:
                extra["lr_scheduler"] = self.lr_scheduler.state_dict()
            torch.save(extra, os.path.join(meta.path, _EXTRA_STATE_NAME))
        if meta.tokenizer is not None and dist.get_rank() == 0:
            meta.tokenizer.save_pretrained(meta.path)
        if not background:
            dist.barrier(group=self.data_parallel_group)
        return background

    def _async_ckpt_group(self) -> Any:
        group = getattr(self, "_ckpt_group", None)
        if group is None:
            group = self._ckpt_group = dist.new_group(backend="gloo")
        return group

    def has_pending_save(self) -> bool:
        return getattr(self, "_pending_save", None) is not None

    def wait_async_save(self) -> str | None:
        """Block until the pending background DCP write (if any) is on disk on every rank;
        returns its directory (``None`` when nothing was pending). Raises what the write
        raised."""
        pending = getattr(self, "_pending_save", None)
        if pending is None:
            return None
        self._pending_save = None
        future, path, t0 = pending
        t_wait = time.perf_counter()
        future.result()
        dist.barrier(group=self.data_parallel_group)
        now = time.perf_counter()
        logger.info(
            "Background DCP write of %s finished %.2fs after the save (waited %.2fs)",
            path,
            now - t0,
            now - t_wait,
        )
        return path

    def _dcp_target(self, meta: SaveLoadMeta) -> dict[str, Any]:
        """What a DCP save or load covers: the sharded model, plus the optimizer with
        ``with_optim``."""
        msd, osd = self._dcp_state()
        state: dict[str, Any] = {"model": msd}
        if meta.with_optim:
            if self.optimizer is None:
                raise ValueError("SaveLoadMeta.with_optim=True but this engine has no optimizer")
            state["optim"] = osd
        return state

    def load(self, meta: SaveLoadMeta) -> None:
        self.wait_async_save()
        if not os.path.isdir(meta.path):
            raise FileNotFoundError(f"SaveLoadMeta.path={meta.path!r} does not exist")
        if meta.weight_format == "hf":
            self._load_hf(meta.path)
            dist.barrier(group=self.data_parallel_group)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._dcp_target(meta)
        dcp.load(state, checkpoint_id=meta.path)
        model = self._require_model()
        if meta.with_optim:
            set_state_dict(
                model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=self._dcp_options(),
            )
        else:
            set_model_state_dict(model, state["model"])
        extra_path = os.path.join(meta.path, _EXTRA_STATE_NAME)
        if os.path.exists(extra_path):
            extra = torch.load(extra_path, weights_only=False)
            self._version = int(extra.get("version", self._version))
            if meta.with_optim and self.lr_scheduler is not None and "lr_scheduler" in extra:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        dist.barrier(group=self.data_parallel_group)
