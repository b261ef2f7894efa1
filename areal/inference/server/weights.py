"""Weight loading for the built-in server: from a safetensors directory or a broadcast group.

The broadcast group follows ``areal.api.io_struct``'s xccl contract: a standalone
``torch.distributed`` process group (its own ``TCPStore`` at ``master_address:master_port``,
keys prefixed by ``group_name``) where the trainer is rank 0 (broadcast root) and the
servers are ranks 1..n. It never touches the default process group, so a trainer that
already runs FSDP can join it too: both sides use ``areal.utils.dist.init_custom_process_group``.

Names are the HuggingFace checkpoint's (``checkpoint_tensors``). Where transformers'
module fuses tensors that the checkpoint keeps apart (mixture-of-experts:
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` on disk, ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]`` in the module), each checkpoint
name is a view of its slice of the fused parameter: loads, broadcasts and fingerprints
all speak the checkpoint layout, which is what trainers export.
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Any

import torch

from areal.api.io_struct import ParamSpec
from areal.utils import logging
from areal.utils.dist import init_custom_process_group  # noqa: F401 - re-exported

logger = logging.getLogger("LocalServerWeights")


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return named


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``named_tensors`` by checkpoint name: fused expert parameters (3-D
    ``*.experts.gate_up_proj`` / ``*.experts.down_proj``) replaced by one view per expert
    and projection (``*.experts.{e}.gate_proj.weight``: rows ``[:I]`` of ``gate_up_proj[e]``,
    ``up_proj``: rows ``[I:]``, ``down_proj``: ``down_proj[e]``); other names unchanged."""
    return checkpoint_views(named_tensors(model))


def checkpoint_views(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``checkpoint_tensors`` of tensors given by module name (the model's own, or a
    staging copy laid out like them)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        prefix, _, leaf = name.rpartition(".")
        if t.ndim == 3 and prefix.endswith(".experts") and leaf == "gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:]
        elif t.ndim == 3 and prefix.endswith(".experts") and leaf == "down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names that alias another tensor (e.g. ``lm_head.weight`` with tied embeddings)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        else:
            seen[id(p)] = name
    return tied


class PendingWeights:
    """The weights served before a versioned update, kept until it is committed or rolled
    back (``weight_routes``): a copy of every tensor on the CPU, in buffers reused from
    one update to the next (one model copy of host memory, no allocation per update)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lora_base: Any = None
        self.active = False
        self.version: int | None = None

    @torch.no_grad()
    def begin(self, model: torch.nn.Module, version: int, lora_base: Any = None) -> None:
        """Copy the live weights aside (once per update: later buckets of the same update
        only move ``version``)."""
        if not self.active:
            tied = tied_names(model)
            for name, t in named_tensors(model).items():
                if name in tied:
                    continue
                buf = self._buffers.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                buf.copy_(t.detach())
            self._lora_base = dict(lora_base) if lora_base is not None else None
            self.active = True
        self.version = int(version)

    def commit(self) -> None:
        """The pending weights are current: forget the copy (its buffers are kept)."""
        self.active = False
        self.version = None
        self._lora_base = None

    @torch.no_grad()
    def rollback(self, model: torch.nn.Module) -> tuple[int, Any] | None:
        """Copy the kept weights back into ``model``; returns (tensors restored, the LoRA
        base weights held before the update), ``None`` when nothing was pending."""
        if not self.active:
            return None
        n = 0
        for name, t in named_tensors(model).items():
            buf = self._buffers.get(name)
            if buf is not None and buf.shape == t.shape:
                t.copy_(buf)
                n += 1
        lora_base = self._lora_base
        self.commit()
        return n, lora_base


class StagedWeights:
    """New weights received while generation goes on (``weight_routes``: an *in-flight*
    update): loaded into a staging copy laid out like the model's tensors, fingerprinted
    there, and copied into the live model only at commit, on the scheduler thread between
    two decode steps; a rollback just drops them. One model copy of host memory, its
    buffers reused from one update to the next.

    ``targets()`` are the staging tensors by checkpoint name (tied names alias their
    source's buffer), what ``load_weights_from_disk`` / ``receive_bucket`` write into."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}  # by module name, tied names aliased
        self._targets: dict[str, torch.Tensor] = {}
        self.active = False
        self.version: int | None = None
        self.lock = threading.Lock()

    @torch.no_grad()
    def begin(self, model: torch.nn.Module, version: int) -> None:
        """Start staging ``version`` from a copy of the live weights (so a tensor no
        update sends stays as it is); a later bucket of the same update only moves
        ``version``."""
        if not self.active:
            by_id: dict[int, torch.Tensor] = {}
            changed = False
            for name, t in named_tensors(model).items():
                buf = by_id.get(id(t))
                if buf is None:
                    buf = self._buffers.get(name)
                    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                        buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                        changed = True
                    buf.copy_(t.detach())
                    by_id[id(t)] = buf
                elif self._buffers.get(name) is not buf:
                    changed = True
                self._buffers[name] = buf
            if changed or not self._targets:
                self._targets = checkpoint_views(self._buffers)
            self.active = True
        self.version = int(version)

    def targets(self) -> dict[str, torch.Tensor]:
        return self._targets

    def receive(self, model: torch.nn.Module, version: int, fill: Any) -> Any:
        """``begin(model, version)``, then ``fill(targets())`` (a loader writing the new
        tensors by checkpoint name), under ``lock``; a fill that raises drops the staged
        weights (half-received weights are never committed). Returns ``fill``'s result."""
        with self.lock:
            self.begin(model, version)
            try:
                return fill(self._targets)
            except BaseException:
                self.discard()
                raise

    @torch.no_grad()
    def commit(self, model: torch.nn.Module) -> int:
        """Copy the staged weights into ``model`` (on the scheduler thread, between two
        steps); returns the number of tensors copied (0 when nothing was staged)."""
        if not self.active:
            return 0
        done: set[int] = set()
        for name, t in named_tensors(model).items():
            buf = self._buffers.get(name)
            if buf is not None and id(t) not in done:
                done.add(id(t))
                t.copy_(buf)
        self.discard()
        return len(done)

    def discard(self) -> bool:
        """Drop the staged weights (kept buffers); True when some were staged."""
        was = self.active
        self.active = False
        self.version = None
        return was


@torch.no_grad()
def load_weights_from_disk(
    model: torch.nn.Module, path: str, into: dict[str, torch.Tensor] | None = None
) -> int:
    """Copy every tensor of ``path/*.safetensors`` into ``model`` in place (``into``: into
    these tensors by checkpoint name instead, e.g. ``StagedWeights.targets()``); returns
    the count."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"weight directory {path!r} does not exist")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    named = checkpoint_tensors(model) if into is None else into
    loaded: set[str] = set()
    unknown: list[str] = []
    for f in files:
        for name, t in load_file(f).items():
            dst = named.get(name)
            if dst is None:
                unknown.append(name)
                continue
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} in {f}, model has {tuple(dst.shape)}"
                )
            dst.copy_(t.to(dst.dtype))
            loaded.add(name)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)} - tied_names(model)
    missing = {n for n in named if n in params or ".experts." in n} - loaded
    if unknown:
        logger.warning(
            "ignored %d unknown tensors from %s, e.g. %s", len(unknown), path, unknown[:3]
        )
    if missing:
        raise ValueError(
            f"{len(missing)} parameters missing from {path!r}, e.g. {sorted(missing)[:3]}"
        )
    return len(loaded)


def _group_device(group, model: torch.nn.Module) -> torch.device:
    """CUDA (the model's device) for an NCCL group, else CPU."""
    model_device = next(model.parameters()).device
    if model_device.type != "cuda":
        return torch.device("cpu")
    try:
        is_nccl = "nccl" in str(group.name()).lower()
    except Exception:  # noqa: BLE001 - a group without a name() is not NCCL here
        is_nccl = isinstance(group, getattr(torch.distributed, "ProcessGroupNCCL", ()))
    return model_device if is_nccl else torch.device("cpu")


@torch.no_grad()
def receive_bucket(
    model: torch.nn.Module,
    group,
    specs: list[ParamSpec],
    into: dict[str, torch.Tensor] | None = None,
) -> int:
    """Receive one broadcast (root 0) per spec, in order, and copy each into ``model``
    (``into``: into these tensors by checkpoint name instead).

    Every announced tensor is received even if its name is unknown (so the group stays in
    step with the trainer); unknown names raise afterwards.
    """
    named = checkpoint_tensors(model) if into is None else into
    unknown: list[str] = []
    # NCCL broadcasts CUDA tensors; gloo CPU tensors.
    device = _group_device(group, model)
    for spec in specs:
        buf = torch.empty(tuple(spec.shape), dtype=getattr(torch, spec.dtype), device=device)
        group.broadcast(buf, 0).wait()
        dst = named.get(spec.name)
        if dst is None or tuple(dst.shape) != tuple(spec.shape):
            unknown.append(spec.name)
            continue
        dst.copy_(buf.to(dst.dtype))
    if unknown:
        raise ValueError(f"received tensors that do not match the model: {unknown[:5]}")
    return len(specs)
