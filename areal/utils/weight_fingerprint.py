"""Cheap fingerprints of model weights (verified weight sync).

A tensor ``x`` (``n`` elements, flattened, viewed as rows of ``ROW`` elements, the last row
possibly shorter) is summarised by a *digest* that does not depend on the seed:

- ``row_sums``: the sum of every row (float32 sums, kept in float64), ``ceil(n / ROW)``
  numbers (groups of consecutive rows summed in float64 beyond ``MAX_SUMS``): every
  element counts, one vectorised reduction (about the cost of reading the tensor once,
  much less when it was just written);
- ``sample``: the elements at fixed strided positions (``SAMPLE`` of them, offset by a CRC
  of the name; every element of a tensor of up to ``FULL_SAMPLE_MAX`` elements), exact.

The *fingerprint* for a ``seed`` is ``k + 3`` numbers computed from the digest alone::

    [g_1 . row_sums, ..., g_k . row_sums, |row_sums|^2, h . sample, |sample|^2]

with ``g_i`` and ``h`` standard normal, drawn from a generator seeded by ``seed`` and the
tensor's name. Any change ``delta`` of one element moves each projection by about
``|delta|`` (k independent chances), far above the round-off of float32 row sums
(``RTOL`` of ``|row_sums|``); a tensor left at its previous version, zeroed, swapped with
another or of another dtype is caught by both parts; a permutation inside one row is
caught by the sample when it moves sampled elements. The sample part is exact (float64 of
float32/bfloat16 values), so it is compared with ``SAMPLE_RTOL``.

Because the digest is seed-free, it is computed where the tensor is touched anyway: the
trainer digests each tensor as it gathers it for the export (``FSDPEngine._gather_buckets``,
``WeightDigests``), the built-in server digests each tensor right after copying it in
(``local_server.weights``). The seeded projections cost a few microseconds per tensor at
check time; the server takes its sample from the live tensor then, so a tensor changed
after the load is still caught. Both sides work on the tensor in the dtype the server
holds. ``AREAL_WEIGHT_DIGESTS=0`` turns the export/load-time digests off (every
fingerprint is then computed from the live tensors when asked: same result, slower).

Used by the built-in server (``POST /weights_fingerprint``), ``FSDPEngine.weights_fingerprint``
and ``areal.infra.weight_verify.WeightFingerprintHook``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import zlib
from collections.abc import Iterable, Mapping

import torch

ROW = 4096
#: At most this many row sums per tensor: larger tensors sum groups of consecutive rows
#: (in float64), so checking costs O(tensors), not O(parameters).
MAX_SUMS = 4096
#: Elements sampled (strided) per tensor; tensors of up to ``FULL_SAMPLE_MAX`` elements
#: are sampled whole.
SAMPLE = 256
FULL_SAMPLE_MAX = 4096
DEFAULT_K = 4
#: Relative tolerance (of |row_sums|) of the row-sum projections: float32 sums of 4096
#: elements computed by other kernels (CPU vs GPU) differ by ~1e-7 relative; a tensor left
#: at its previous version differs by at least one optimizer step, typically > 1e-5.
RTOL = 2e-6
#: Relative tolerance (of |sample|) of the sample part: exact values, float64 dot products.
SAMPLE_RTOL = 1e-9
ENV_DIGESTS = "AREAL_WEIGHT_DIGESTS"


def digests_enabled() -> bool:
    """Whether export/load-time digests are computed (``AREAL_WEIGHT_DIGESTS`` != "0")."""
    return os.environ.get(ENV_DIGESTS, "1").strip() != "0"


@dataclasses.dataclass
class TensorDigest:
    """Seed-free summary of one tensor: float64 CPU ``row_sums`` and ``sample``."""

    row_sums: torch.Tensor
    sample: torch.Tensor


def _sample_slice(name: str, n: int) -> tuple[int, int, int]:
    """(offset, stride, count) of the sampled elements of a tensor of ``n`` elements."""
    if n <= FULL_SAMPLE_MAX:
        return 0, 1, n
    stride = n // SAMPLE
    offset = zlib.crc32(name.encode()) % stride
    return offset, stride, SAMPLE


@torch.no_grad()
def tensor_sample(name: str, t: torch.Tensor) -> torch.Tensor:
    """The sampled elements of ``t`` (see the module doc), float64 on the CPU."""
    flat = t.detach().reshape(-1)
    offset, stride, count = _sample_slice(name, flat.numel())
    return flat[offset : offset + stride * count : stride].to("cpu", torch.float64)


@torch.no_grad()
def digest_tensor(name: str, t: torch.Tensor) -> TensorDigest:
    """Row sums and sample of ``t`` (one vectorised pass, no full-size copy). A tensor of
    at most ``FULL_SAMPLE_MAX`` elements is sampled whole; its one "row sum" is then the
    float64 sum of the sample (a few operations: most tensors of a model are small)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= FULL_SAMPLE_MAX:
        sample = flat.to("cpu", torch.float64)
        return TensorDigest(sample.sum().reshape(1), sample)
    full = n // ROW
    row_sums = flat[: full * ROW].view(full, ROW).sum(1, dtype=torch.float32)
    if n > full * ROW:  # the short last row
        tail = flat[full * ROW :].sum(dtype=torch.float32).reshape(1)
        row_sums = torch.cat([row_sums, tail])
    row_sums = row_sums.to("cpu", torch.float64)
    group = _group(n)
    if group > 1:  # consecutive rows summed (float64) so that at most MAX_SUMS remain
        pad = -row_sums.numel() % group
        row_sums = torch.nn.functional.pad(row_sums, (0, pad)).view(-1, group).sum(1)
    return TensorDigest(row_sums, tensor_sample(name, flat))


def _group(n: int) -> int:
    """Rows summed together in the digest of a tensor of ``n`` elements."""
    return max(1, math.ceil(math.ceil(n / ROW) / MAX_SUMS))


def _n_sums(n: int) -> int:
    """Length of the ``row_sums`` of a tensor of ``n`` elements."""
    return max(1, math.ceil(math.ceil(n / ROW) / _group(n)))


_M64 = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser (Python ints): per-tensor constants from (seed, name, i)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _frac(x: torch.Tensor) -> torch.Tensor:
    return x - torch.floor(x)


def _weights(pos: torch.Tensor, consts: torch.Tensor) -> torch.Tensor:
    """Pseudo-random weights ``+-[0.5, 1)`` (float64 ``[N, m]``) of element ``pos``
    (float64 ``[N]``) for each constant pair (``consts``: float64 ``[N, m, 2]`` in
    ``[0, 1)``): a Weyl sequence ``frac(pos * a + b)`` with a random step ``a`` in
    ``[0.5, 1)`` per tensor, seed and projection. Plain IEEE arithmetic, so other machines
    draw the same to round-off; no weight is near zero, so one changed element moves every
    projection by at least half its change."""
    u = _frac(pos[:, None] * (0.5 + 0.5 * consts[..., 0]) + consts[..., 1])
    return torch.where(u < 0.5, -0.5 - u, u)


def _consts(names: list[str], seed: int, m: int, salt: int) -> torch.Tensor:
    """float64 ``[len(names), m, 2]`` constants in ``[0, 1)`` for ``(seed, name, salt)``:
    one splitmix64 draw per name, spread over the ``2m`` constants by irrational steps."""
    base = (
        torch.tensor(
            [_mix((seed * 1_000_003 + zlib.crc32(n.encode())) ^ (salt << 56)) >> 11 for n in names],
            dtype=torch.float64,
        )
        / 2.0**53
    )
    j = torch.arange(1, 2 * m + 1, dtype=torch.float64)
    c = _frac(base[:, None] * (1.0 + 0.7548776662466927 * j) + 0.5698402909980532 * j)
    return c.reshape(len(names), m, 2)


def _segment_projections(
    vectors: list[torch.Tensor], consts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each vector v_t (float64): ``[w_t,i . v_t for i < m]`` and ``v_t . v_t``, all
    vectors at once (concatenated, weights drawn per element, segment sums)."""
    n_t = len(vectors)
    m = consts.shape[1]
    lengths = torch.tensor([v.numel() for v in vectors], dtype=torch.int64)
    flat = torch.cat(vectors) if n_t else torch.zeros(0, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(n_t), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = (torch.arange(flat.numel(), dtype=torch.int64) - starts[ids]).to(torch.float64)
    w = _weights(pos, consts[ids])
    proj = torch.zeros(n_t, m, dtype=torch.float64).index_add_(0, ids, w * flat[:, None])
    sq = torch.zeros(n_t, dtype=torch.float64).index_add_(0, ids, flat * flat)
    return proj, sq


@torch.no_grad()
def fingerprint_digests(
    digests: Mapping[str, TensorDigest] | Iterable[tuple[str, TensorDigest]],
    seed: int = 0,
    k: int = DEFAULT_K,
) -> dict[str, list[float]]:
    """Fingerprints (``k + 3`` numbers each, module doc) of many digests at once: a few
    vectorised operations whatever the number of tensors."""
    items = list(digests.items() if isinstance(digests, Mapping) else digests)
    if not items:
        return {}
    names = [n for n, _ in items]
    proj, s_sq = _segment_projections([d.row_sums for _, d in items], _consts(names, seed, k, 1))
    q, x_sq = _segment_projections([d.sample for _, d in items], _consts(names, seed, 1, 2))
    table = torch.cat([proj, s_sq[:, None], q, x_sq[:, None]], dim=1).tolist()
    return dict(zip(names, table))


def fingerprint_from_digest(
    name: str, digest: TensorDigest, seed: int = 0, k: int = DEFAULT_K
) -> list[float]:
    """The ``k + 3`` numbers of ``name``'s fingerprint for ``seed`` (module doc)."""
    return fingerprint_digests([(name, digest)], seed, k)[name]


def fingerprint_tensor(
    name: str, t: torch.Tensor, seed: int = 0, k: int = DEFAULT_K
) -> list[float]:
    """Fingerprint of ``t`` computed from the tensor itself."""
    return fingerprint_from_digest(name, digest_tensor(name, t), seed, k)


def fingerprint_named(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    seed: int = 0,
    dtypes: Mapping[str, str] | None = None,
    k: int = DEFAULT_K,
    digests: Mapping[str, TensorDigest] | None = None,
) -> dict[str, list[float]]:
    """Fingerprints by name; ``dtypes[name]`` (e.g. ``"bfloat16"``) casts a tensor first.

    ``digests[name]`` (taken when the tensor was last written, e.g. by the server's weight
    loader) supplies the row sums; the sample is always read from the live tensor."""
    items = named.items() if isinstance(named, Mapping) else named
    out = []
    for name, t in items:
        dt = (dtypes or {}).get(name)
        if dt is not None:
            t = t.to(getattr(torch, dt))
        d = (digests or {}).get(name) if dt is None else None
        if d is not None and d.row_sums.numel() == _n_sums(t.numel()):
            d = TensorDigest(d.row_sums, tensor_sample(name, t))
        else:
            d = digest_tensor(name, t)
        out.append((name, d))
    return fingerprint_digests(out, seed, k)


class DigestMap(dict):
    """``{name: TensorDigest}`` plus ``seconds``: the time spent taking them (server side)."""

    seconds: float = 0.0

    def add(self, name: str, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self[name] = digest_tensor(name, t)
        self.seconds += time.perf_counter() - t0


class WeightDigests:
    """Digests of exported tensors, taken while they are gathered (trainer side).

    ``add(name, tensor)`` digests when ``enabled`` (e.g. only on the rank that answers);
    ``complete`` is set by the exporter once every tensor went through ``add``.
    ``fingerprints(seed)`` then answers without touching the weights again; ``seconds``
    is the time the digests took."""

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled) and digests_enabled()
        self.usable = digests_enabled()  # the same on every rank (same environment)
        self.digests = DigestMap()
        self.complete = False

    @property
    def seconds(self) -> float:
        return self.digests.seconds

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.enabled:
            self.digests.add(name, t)

    def fingerprints(self, seed: int = 0, k: int = DEFAULT_K) -> dict[str, list[float]]:
        return fingerprint_digests(self.digests, seed, k)


def compare_fingerprints(
    reference: Mapping[str, list[float]],
    got: Mapping[str, list[float]],
    rtol: float = RTOL,
    sample_rtol: float = SAMPLE_RTOL,
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
        if len(fp) != len(ref) or len(ref) < 4:
            bad.append(f"{name} (fingerprint of length {len(fp)}, expected {len(ref)})")
            continue
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in fp):
            bad.append(f"{name} (malformed fingerprint from the server: {str(fp)[:80]})")
            continue
        k = len(ref) - 3
        s_sq, x_sq = max(ref[k], 0.0), max(ref[k + 2], 0.0)
        scale = math.sqrt(s_sq) + 1e-30  # |row_sums|: the std of a projection
        d_proj = max(abs(a - b) for a, b in zip(ref[:k], fp[:k]))
        if d_proj > rtol * scale or abs(s_sq - fp[k]) > 4 * rtol * (s_sq + 1e-30):
            bad.append(f"{name} (row-sum projection differs by {d_proj:.3g}, |sums| {scale:.3g})")
            continue
        x_scale = math.sqrt(x_sq) + 1e-30
        d_sample = abs(ref[k + 1] - fp[k + 1])
        if d_sample > sample_rtol * x_scale or abs(x_sq - fp[k + 2]) > 4 * sample_rtol * (
            x_sq + 1e-30
        ):
            bad.append(
                f"{name} (sampled elements differ: projection by {d_sample:.3g}, "
                f"|sample| {x_scale:.3g})"
            )
    return bad
