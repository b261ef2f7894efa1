"""Delta weight transfer: the elements of a model that changed since the servers' last
committed version, as flat indices + new values (``docs/weight_sync.md``, "Delta weight
transfer").

Layout of one delta, written into ``<update dir>/delta/`` (``DELTA_DIR``)::

    manifest.json          {"format": "areal-weight-delta", "format_version": 1,
                            "base_version", "version", "dtype", "files", "totals",
                            "tensors": {name: {"mode", "shape", "numel", "changed",
                                               "bytes", "file"}}}
    delta-00000.safetensors
                           per tensor, by mode:
                           "sparse":    ``idx/<name>`` (int32 when numel < 2**31, else
                                        int64: flat positions) and ``val/<name>`` (the new
                                        values, in ``dtype``, in the order of the
                                        positions)
                           "mask":      ``mask/<name>`` (one bit per element, packed
                                        little-endian into uint8: changed or not) and
                                        ``val/<name>``: fewer bytes than the positions
                                        once more than 1/32 of an int32-indexed tensor
                                        changed
                           "dense":     ``dense/<name>`` (the whole new tensor: when
                                        neither form above would be smaller)
                           "unchanged": nothing

Each tensor gets the smallest of these.

Values are compared bit for bit in the servers' dtype (``encode_tensor``), so applying a
delta to the base (``apply_delta``) gives exactly the new weights cast to that dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch

FORMAT = "areal-weight-delta"
FORMAT_VERSION = 1
DELTA_DIR = "delta"
MANIFEST = "manifest.json"
#: a delta file is closed once it holds this many bytes (a larger tensor gets one alone)
SHARD_BYTES = 512 << 20

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeltaRefused(ValueError):
    """A delta that does not apply to these weights (base version, dtype, names, shapes)."""


def dtype_of(name: str) -> torch.dtype:
    """``torch`` dtype of ``"bfloat16"`` / ``"float16"`` / ``"float32"``."""
    if name not in DTYPES:
        raise ValueError(f"delta dtype {name!r}; allowed: {sorted(DTYPES)}")
    return DTYPES[name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, viewed as integers of its element size (exact comparison: -0.0 != 0.0,
    NaNs compare by payload)."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as uint8, 8 elements a byte (element ``i`` is bit ``i % 8`` of
    byte ``i // 8``)."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    padded[:n] = mask.reshape(-1)
    return (padded.view(-1, 8) * _BITS).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """``pack_mask``'s inverse: a flat bool tensor of ``numel`` elements."""
    return ((packed.reshape(-1, 1) & _BITS) != 0).reshape(-1)[:numel]


def encode_tensor(
    new: torch.Tensor, base: torch.Tensor
) -> tuple[str, dict[str, torch.Tensor], int]:
    """``(mode, tensors, changed)`` of one tensor: ``new`` against ``base`` (same shape and
    dtype, CPU). ``tensors`` by suffix: ``{"idx", "val"}`` (sparse), ``{"mask", "val"}``
    (mask), ``{"dense"}`` or ``{}`` (unchanged): the form with the fewest bytes (module
    docstring), dense on a tie."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(
            f"delta of {tuple(new.shape)} {new.dtype} against {tuple(base.shape)} {base.dtype}"
        )
    new = new.contiguous()
    changed_mask = _bits(new) != _bits(base.contiguous())
    idx = changed_mask.nonzero().reshape(-1)
    k = int(idx.numel())
    if k == 0:
        return "unchanged", {}, 0
    numel, es = new.numel(), new.element_size()
    ity = index_dtype(numel)
    sparse_bytes = k * (torch.empty((), dtype=ity).element_size() + es)
    mask_bytes = -(-numel // 8) + k * es
    if min(sparse_bytes, mask_bytes) >= numel * es:
        return "dense", {"dense": new.reshape(-1).clone()}, k
    if mask_bytes < sparse_bytes:
        return "mask", {"mask": pack_mask(changed_mask), "val": new.reshape(-1)[idx]}, k
    return "sparse", {"idx": idx.to(ity), "val": new.reshape(-1)[idx]}, k


class DeltaWriter:
    """Writes one delta into ``path`` (``DELTA_DIR`` layout, module docstring; earlier
    files there are removed), tensor by tensor: ``add(name, new, base)`` (CPU tensors in
    ``dtype``) encodes and stages it (files of ``SHARD_BYTES``), ``close()`` writes the
    manifest and returns it."""

    def __init__(self, path: str, base_version: int, version: int, dtype: str):
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(path):
            if f.endswith(".safetensors") or f == MANIFEST:
                os.remove(os.path.join(path, f))
        self.path = path
        self.base_version, self.version, self.dtype = int(base_version), int(version), dtype
        self.tensors: dict[str, dict[str, Any]] = {}
        self.files: list[str] = []
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self.totals = dict.fromkeys(
            ("numel", "changed", "bytes", "dense_bytes", "tensors", "sparse_tensors"), 0
        )
        self.totals.update({"mask_tensors": 0, "dense_tensors": 0, "unchanged_tensors": 0})

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self._shard:
            name = f"delta-{len(self.files):05d}.safetensors"
            save_file(self._shard, os.path.join(self.path, name), metadata={"format": FORMAT})
            self.files.append(name)
        self._shard, self._shard_bytes = {}, 0

    def add(self, name: str, new: torch.Tensor, base: torch.Tensor) -> tuple[str, dict]:
        """Encode ``new`` against ``base`` and stage it; returns ``(mode, parts)``
        (``encode_tensor``)."""
        mode, parts, k = encode_tensor(new, base)
        nbytes = sum(t.numel() * t.element_size() for t in parts.values())
        if self._shard and self._shard_bytes + nbytes > SHARD_BYTES:
            self._flush()
        for suffix, t in parts.items():
            self._shard[f"{suffix}/{name}"] = t
        self._shard_bytes += nbytes
        numel = int(new.numel())
        self.tensors[name] = {
            "mode": mode,
            "shape": list(new.shape),
            "numel": numel,
            "changed": k,
            "bytes": nbytes,
            "file": f"delta-{len(self.files):05d}.safetensors" if parts else None,
        }
        t = self.totals
        t["numel"] += numel
        t["changed"] += k
        t["bytes"] += nbytes
        t["dense_bytes"] += numel * new.element_size()
        t["tensors"] += 1
        t[f"{mode}_tensors"] += 1
        return mode, parts

    def close(self) -> dict[str, Any]:
        self._flush()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "base_version": self.base_version,
            "version": self.version,
            "dtype": self.dtype,
            "files": list(self.files),
            "totals": dict(self.totals),
            "tensors": self.tensors,
        }
        tmp = os.path.join(self.path, f".{MANIFEST}.tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(self.path, MANIFEST))
        return manifest


def write_delta(
    path: str,
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
    base_version: int,
    version: int,
    dtype: str,
) -> dict[str, Any]:
    """``DeltaWriter`` over every ``(name, new, base)``; returns the manifest."""
    w = DeltaWriter(path, base_version, version, dtype)
    for name, new, base in pairs:
        w.add(name, new, base)
    return w.close()


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the delta in ``path`` (``DeltaRefused`` when absent or malformed)."""
    f = os.path.join(path, MANIFEST)
    try:
        with open(f) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise DeltaRefused(f"no delta manifest {f!r}") from None
    except (OSError, ValueError) as e:
        raise DeltaRefused(f"unreadable delta manifest {f!r}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DeltaRefused(f"{f!r} is not an {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DeltaRefused(
            f"{f!r}: format_version {manifest.get('format_version')!r}; this reader knows "
            f"{FORMAT_VERSION}"
        )
    return manifest


def check_delta(manifest: dict[str, Any], current_version: int, dtype: torch.dtype) -> None:
    """``DeltaRefused`` unless the delta's base is ``current_version`` and its dtype
    ``dtype``."""
    base = manifest.get("base_version")
    if base != current_version:
        raise DeltaRefused(
            f"delta to version {manifest.get('version')} is against base version {base}; "
            f"this server holds version {current_version}: a full weight update is needed"
        )
    want = str(dtype).removeprefix("torch.")
    if manifest.get("dtype") != want:
        raise DeltaRefused(
            f"delta in dtype {manifest.get('dtype')!r}; this server's model is in {want!r}"
        )


@torch.no_grad()
def apply_delta(path: str, targets: dict[str, torch.Tensor], manifest: dict[str, Any]) -> int:
    """Apply the delta in ``path`` (its ``manifest``, already checked) to ``targets`` (by
    name, in place). Every name and shape is checked before any tensor is written
    (``DeltaRefused``). Returns the number of tensors written."""
    from safetensors import safe_open

    entries = manifest.get("tensors") or {}
    for name, e in entries.items():
        dst = targets.get(name)
        if dst is None:
            raise DeltaRefused(f"delta names tensor {name!r}, which this model does not have")
        if list(dst.shape) != list(e["shape"]):
            raise DeltaRefused(
                f"{name}: shape {e['shape']} in the delta, model has {list(dst.shape)}"
            )
    n = 0
    by_file: dict[str, list[str]] = {}
    for name, e in entries.items():
        if e["mode"] != "unchanged":
            by_file.setdefault(e["file"], []).append(name)
    for fname, names in by_file.items():
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for name in names:
                dst, mode = targets[name], entries[name]["mode"]
                if mode == "dense":
                    dst.copy_(f.get_tensor(f"dense/{name}").view(dst.shape))
                elif mode in ("sparse", "mask"):
                    if mode == "sparse":
                        idx = f.get_tensor(f"idx/{name}").long()
                    else:
                        packed = f.get_tensor(f"mask/{name}")
                        idx = unpack_mask(packed, dst.numel()).nonzero().reshape(-1)
                    idx = idx.to(dst.device)  # (a CUDA server: the files load on the CPU)
                    val = f.get_tensor(f"val/{name}").to(device=dst.device, dtype=dst.dtype)
                    if idx.numel() != val.numel():
                        raise DeltaRefused(f"{name}: {idx.numel()} positions, {val.numel()} values")
                    if dst.is_contiguous():
                        dst.view(-1)[idx] = val
                    else:  # a view into a fused tensor (checkpoint_views)
                        flat = dst.contiguous().view(-1)
                        flat[idx] = val
                        dst.copy_(flat.view(dst.shape))
                else:
                    raise DeltaRefused(f"{name}: unknown delta mode {mode!r}")
                n += 1
    return n


def apply_entries(base: dict[str, torch.Tensor], encoded: dict[str, tuple]) -> None:
    """Apply ``{name: (mode, parts)}`` (``encode_tensor``'s output) to ``base`` in place
    (the trainer's committed copy moving to the committed version)."""
    for name, (mode, parts) in encoded.items():
        dst = base[name]
        if mode == "dense":
            dst.view(-1).copy_(parts["dense"])
        elif mode == "sparse":
            dst.view(-1)[parts["idx"].long()] = parts["val"]
        elif mode == "mask":
            dst.view(-1)[unpack_mask(parts["mask"], dst.numel())] = parts["val"]
