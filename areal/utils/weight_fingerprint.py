"""Cheap, exact-enough fingerprints of model weights (verified weight sync).

The fingerprint of one tensor ``x`` (``n`` elements, zero-padded to rows of ``ROW``
elements: ``X`` of shape ``[rows, ROW]``) is::

    [c @ X @ R[:, 0], ..., c @ X @ R[:, k-1], sum(x * x)]

with ``R`` (``[ROW, k]``) and ``c`` (``[rows]``) standard normal, drawn from generators
seeded by ``seed`` and by ``seed`` + a CRC of the tensor's name. ``c @ X`` is computed
block by block in float32 (partial sums accumulated in float64), so it costs about two
multiply-adds per element and no copy of the tensor: a few percent of moving it. Any
change ``delta`` moves each projection by about ``|delta|`` (a tensor left at its old
value, a swapped or zeroed tensor), far above the round-off (``RTOL`` of ``|x|``). Both
sides compute it from the tensor in the dtype the server holds (float32 of a bfloat16
value is exact), so the trainer's and the server's fingerprints agree to round-off unless
the weights differ.

Used by the built-in server (``POST /weights_fingerprint``), ``FSDPEngine.weights_fingerprint``
and ``areal.infra.weight_verify.WeightFingerprintHook``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import torch

ROW = 1024
#: Rows per block: the tensor is read in float32 blocks of ``BLOCK_ROWS * ROW`` elements
#: (no full-size copy); each block's partial sums are accumulated in float64.
BLOCK_ROWS = 512
DEFAULT_K = 4
#: Relative tolerance (of |x|): float32 block sums computed by other kernels (CPU vs GPU)
#: differ by ~1e-7 relative; a tensor left at its previous version differs by at least one
#: optimizer step, typically > 1e-5 relative.
RTOL = 2e-6

_R_CACHE: dict[tuple[int, int, str], torch.Tensor] = {}


def _projection(seed: int, k: int, device: torch.device) -> torch.Tensor:
    key = (seed, k, str(device))
    r = _R_CACHE.get(key)
    if r is None:
        g = torch.Generator().manual_seed(seed)
        r = torch.randn(ROW, k, generator=g, dtype=torch.float64).to(device)
        if len(_R_CACHE) > 16:
            _R_CACHE.clear()
        _R_CACHE[key] = r
    return r


@torch.no_grad()
def fingerprint_tensor(
    name: str, t: torch.Tensor, seed: int = 0, k: int = DEFAULT_K
) -> list[float]:
    """``k`` random projections and the sum of squares of ``t`` (see the module doc)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    full_rows = n // ROW
    rows = max(1, math.ceil(n / ROW))
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    c = torch.randn(rows, generator=g, dtype=torch.float32).to(flat.device)
    v = torch.zeros(ROW, dtype=torch.float64, device=flat.device)
    sq = torch.zeros((), dtype=torch.float64, device=flat.device)
    for r0 in range(0, full_rows, BLOCK_ROWS):
        r1 = min(full_rows, r0 + BLOCK_ROWS)
        blk = flat[r0 * ROW : r1 * ROW].to(torch.float32).view(r1 - r0, ROW)
        v += (c[r0:r1] @ blk).to(torch.float64)
        b = blk.view(-1)
        sq += torch.dot(b, b).to(torch.float64)
    if full_rows * ROW < n:  # the tail row, zero-padded
        tail = flat[full_rows * ROW :].to(torch.float64)
        v[: tail.numel()] += c[-1].to(torch.float64) * tail
        sq += torch.dot(tail, tail)
    proj = v @ _projection(seed, k, flat.device)
    return [float(p) for p in proj.tolist()] + [float(sq)]


def fingerprint_named(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    seed: int = 0,
    dtypes: Mapping[str, str] | None = None,
    k: int = DEFAULT_K,
) -> dict[str, list[float]]:
    """Fingerprints by name; ``dtypes[name]`` (e.g. ``"bfloat16"``) casts a tensor first."""
    items = named.items() if isinstance(named, Mapping) else named
    out = {}
    for name, t in items:
        dt = (dtypes or {}).get(name)
        if dt is not None:
            t = t.to(getattr(torch, dt))
        out[name] = fingerprint_tensor(name, t, seed, k)
    return out


def compare_fingerprints(
    reference: Mapping[str, list[float]], got: Mapping[str, list[float]], rtol: float = RTOL
) -> list[str]:
    """Names of the tensors of ``reference`` that ``got`` lacks or whose fingerprint differs
    (with how much), in reference order; names only ``got`` has are ignored (e.g. a tied
    ``lm_head.weight``)."""
    bad = []
    for name, ref in reference.items():
        fp = got.get(name)
        if fp is None:
            bad.append(f"{name} (missing on the server)")
            continue
        if len(fp) != len(ref):
            bad.append(f"{name} (fingerprint of length {len(fp)}, expected {len(ref)})")
            continue
        scale = math.sqrt(max(ref[-1], 0.0)) + 1e-30  # |x|: the std of a projection
        tol = rtol * scale
        diffs = [abs(a - b) for a, b in zip(ref[:-1], fp[:-1])]
        d_sq = abs(ref[-1] - fp[-1])
        if max(diffs, default=0.0) > tol or d_sq > rtol * (abs(ref[-1]) + 1e-30):
            bad.append(
                f"{name} (projection differs by {max(diffs, default=0.0):.3g}, |x| {scale:.3g})"
            )
    return bad
