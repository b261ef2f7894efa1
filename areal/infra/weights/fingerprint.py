"""Cheap fingerprints of model weights (verified weight sync).

A tensor ``x`` (``n`` elements, flattened) is summarised by a *digest* that does not
depend on the seed, in one of two forms:

- *sample only*: the elements at fixed strided positions (``SAMPLE`` of them, offset by a
  CRC of the name; every element of a tensor of up to ``FULL_SAMPLE_MAX`` elements),
  exact. Costs a few microseconds whatever the tensor's size; catches a tensor left at
  its previous version, zeroed, noisy or swapped as soon as a sampled element differs
  (every element of a matrix trained by Adam moves in every step), and any change of a
  small tensor (norms, biases: sampled whole);
- *full*: the sample plus ``row_sums``, the float32 sums of rows of ``ROW`` consecutive
  elements (kept in float64; groups of rows summed beyond ``MAX_SUMS``): every element
  counts, about one read of the tensor.

Which tensors get the full form is chosen per check by ``rotation_share``: the tensors
are split into ``every`` groups of about equal size and each check takes the next group,
so every element of every tensor is covered once every ``every`` checks at ``1/every`` of
the cost (``every=1``: all tensors in full at every check).

The *fingerprint* of a digest::

    full:         [g_1 . row_sums, ..., g_k . row_sums, |row_sums|^2, checksum, |sample|^2]
    sample only:  [checksum, |sample|^2]

The sample is compared exactly: ``checksum`` is a 53-bit integer (held in a float) of the
float64 bit patterns of the sampled values, each multiplied by an odd constant drawn from
the tensor's name and the element's position, so a changed, swapped or shifted element
changes it. The row sums are projected on pseudo-random weights ``g_i`` in ``+-[0.5, 1)``
drawn from the tensor's name, the element's position and ``i``: any change ``delta`` of
one row sum moves each projection by at least ``|delta| / 2`` (k chances), far above the
round-off of float32 row sums (``RTOL`` of ``|row_sums|``, e.g. CPU vs GPU kernels). Both
sides work on the tensor in the dtype the server holds. None of these constants depends on
the check, so they are drawn once per layout (names and sizes) and cached; the *seed* a
check carries only names it (a server's answer is matched to the reference by it).

Cost: per check, a handful of NumPy calls over all samples at once (gather, checksum,
norms) whatever the number of tensors, the row sums of the share and their projections;
per tensor, one strided view (the server keeps its views: its tensors are updated in
place; so does the trainer when its exports are its live parameters). ``Packed`` carries
the numbers as base64 float64 bytes (the decimal repr of a float costs ~1 us each way).
The trainer digests each tensor as it gathers it for the export (``FSDPEngine``,
``WeightDigests``); the built-in server digests its live tensors after a load or when asked
(``POST /weights_fingerprint``, with the names to digest in full; ``LiveFingerprints``).
Used by ``areal.infra.weight_verify``.
"""

from __future__ import annotations

import functools
import math
import time
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
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
#: Relative tolerance of ``|sample|^2`` (float64 sums of the same values; the checksum
#: itself is compared exactly).
SAMPLE_RTOL = 1e-9


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)
_M64 = 2**64 - 1


@functools.lru_cache(maxsize=1 << 16)
def _sample_slice(name: str, n: int) -> tuple[int, int, int]:
    """(offset, stride, count) of the sampled elements of a tensor of ``n`` elements."""
    if n <= FULL_SAMPLE_MAX:
        return 0, 1, n
    stride = n // SAMPLE
    offset = zlib.crc32(name.encode()) % stride
    return offset, stride, SAMPLE


@functools.lru_cache(maxsize=1 << 16)
def _crc(name: str) -> int:
    return zlib.crc32(name.encode())


#: Row sums of CPU tensors of up to this many elements are taken with NumPy.
_NUMPY_ROWS_MAX = 1 << 16


def _row_sums(flat: torch.Tensor) -> np.ndarray:
    """float64 row sums (module doc) of a flat tensor of more than ``ROW`` elements."""
    n = flat.numel()
    whole = n // ROW
    if n <= _NUMPY_ROWS_MAX and flat.device.type == "cpu" and flat.dtype in _NUMPY_DTYPES:
        # small tensors: NumPy has less overhead per call (torch's vectorised sums are
        # ~3x faster per element); same size, same path on both sides
        a = flat.numpy()
        sums = a[: whole * ROW].reshape(whole, ROW).sum(1, dtype=np.float32)
        if n > whole * ROW:  # the short last row
            sums = np.append(sums, a[whole * ROW :].sum(dtype=np.float32))
        sums = sums.astype(np.float64)
    else:
        t = flat[: whole * ROW].view(whole, ROW).sum(1, dtype=torch.float32)
        if n > whole * ROW:
            t = torch.cat([t, flat[whole * ROW :].sum(dtype=torch.float32).reshape(1)])
        sums = t.to("cpu", torch.float64).numpy()
    group = _group(n)
    if group > 1:  # consecutive rows summed (float64) so that at most MAX_SUMS remain
        sums = np.pad(sums, (0, -sums.size % group)).reshape(-1, group).sum(1)
    return sums


def _group(n: int) -> int:
    """Rows summed together in the digest of a tensor of ``n`` elements."""
    return max(1, math.ceil(math.ceil(n / ROW) / MAX_SUMS))


@functools.lru_cache(maxsize=64)
def _rotation_groups(sizes: tuple[tuple[str, int], ...], every: int) -> dict[str, int]:
    """The group (``< every``) of each tensor of more than ``FULL_SAMPLE_MAX`` elements."""
    groups = [0] * every
    out: dict[str, int] = {}
    for name, n in sorted(sizes, key=lambda s: (-s[1], s[0])):
        if n <= FULL_SAMPLE_MAX:
            continue
        g = min(range(every), key=lambda i: (groups[i], i))
        groups[g] += n
        out[name] = g
    return out


def rotation_share(sizes: Sequence[tuple[str, int]], every: int, index: int) -> set[str]:
    """Names whose row sums are taken at check number ``index``: the tensors of more than
    ``FULL_SAMPLE_MAX`` elements (``sizes``: ``(name, numel)``) are split into ``every``
    groups of about equal size (largest first, each into the smallest group so far; ties
    by name, so the split depends only on ``sizes``) and group ``index % every`` is taken.
    Over ``every`` consecutive checks every tensor is digested in full once (the split is
    cached per ``sizes``)."""
    if every <= 1:
        return {name for name, n in sizes if n > FULL_SAMPLE_MAX}
    g = index % every
    groups = _rotation_groups(tuple((name, int(n)) for name, n in sizes), every)
    return {name for name, i in groups.items() if i == g}


_GOLDEN, _MIX1, _MIX2 = (
    np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)
_S11, _S27, _S30, _S31, _S32 = (np.uint64(c) for c in (11, 27, 30, 31, 32))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return x


class _Layout:
    """What depends only on the names and sample counts of the tensors laid end to end:
    the segment starts and the checksum multipliers of every sampled element (odd,
    splitmix64 of the name's CRC and the position). Cached (``_layout``)."""

    def __init__(self, names: tuple[str, ...], counts: tuple[int, ...]):
        lengths = np.array(counts, dtype=np.int64)
        self.n = len(names)
        self.size = int(lengths.sum())
        self.keep = np.flatnonzero(lengths)  # reduceat needs non-empty segments
        starts = np.cumsum(lengths) - lengths
        self.starts = starts[self.keep]
        self.all_kept = self.keep.size == self.n
        keys = np.fromiter((_crc(n) for n in names), dtype=np.uint64, count=self.n)
        pos = np.arange(self.size, dtype=np.uint64) - np.repeat(starts, lengths).astype(np.uint64)
        self.mult = _mix((np.repeat(keys, lengths) << _S32) + pos) | np.uint64(1)

    def sample_parts(self, flat: np.ndarray) -> np.ndarray:
        """float64 ``[n, 2]``: the checksum and ``|sample|^2`` of each tensor's sample
        (``flat``: the float64 samples laid end to end)."""
        out = np.zeros((self.n, 2))
        if self.keep.size == 0:
            return out
        ck = np.add.reduceat(flat.view(np.uint64) * self.mult, self.starts)
        sq = np.add.reduceat(flat * flat, self.starts)
        if self.all_kept:
            out[:, 0] = ck >> _S11  # 53 bits: exact in a float64 (and in JSON)
            out[:, 1] = sq
        else:
            out[self.keep, 0] = ck >> _S11
            out[self.keep, 1] = sq
        return out


_LAYOUTS: dict[tuple, _Layout] = {}


def _layout(names: Sequence[str], counts: Sequence[int]) -> _Layout:
    key = (tuple(names), tuple(counts))
    lay = _LAYOUTS.get(key)
    if lay is None:
        if len(_LAYOUTS) >= 16:  # a few models / buckets per process
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        lay = _LAYOUTS[key] = _Layout(*key)
    return lay


def _weights(pos: np.ndarray, consts: np.ndarray) -> np.ndarray:
    """Pseudo-random weights ``+-[0.5, 1)`` (float64 ``[N, m]``) of element ``pos``
    (float64 ``[N]``) for each constant pair (``consts``: float64 ``[N, m, 2]`` in
    ``[0, 1)``): a Weyl sequence ``frac(pos * a + b)`` with a random step ``a`` in
    ``[0.5, 1)`` per tensor and projection. Plain IEEE arithmetic, so other machines
    draw the same to round-off; no weight is near zero, so one changed element moves every
    projection by at least half its change."""
    u = pos[:, None] * (0.5 + 0.5 * consts[..., 0]) + consts[..., 1]
    u -= np.floor(u)
    return np.where(u < 0.5, -0.5 - u, u)


def _consts(keys: np.ndarray, m: int, salt: int) -> np.ndarray:
    """float64 ``[len(keys), m, 2]`` constants in ``[0, 1)`` for ``(name, salt)``
    (``keys``: uint64 CRCs of the names): one splitmix64 draw per name, spread over the
    ``2m`` constants by irrational steps."""
    if m > len(_STEPS):
        raise ValueError(f"k={m} projections; at most {len(_STEPS)}")
    base = (_mix(keys ^ np.uint64((salt << 56) & _M64)) >> _S11) * (1.0 / 2.0**53)
    c = base[:, None, None] * _STEPS[:m] + _OFFSETS[:m]
    c -= np.floor(c)
    return c


#: The irrational steps of ``_consts`` (up to ``m = 64`` projections).
_J = np.arange(1, 129, dtype=np.float64).reshape(64, 2)
_STEPS = 1.0 + 0.7548776662466927 * _J
_OFFSETS = 0.5698402909980532 * _J


class _RowLayout:
    """The row-sum projection weights ``g_t,i`` (float64 ``[N, k]``, ``_weights`` of the
    name and the position) of tensors with ``lens`` row sums laid end to end, and the
    segment starts. Cached (``_row_projections``; the rotation shares repeat)."""

    def __init__(self, names: tuple[str, ...], lens: tuple[int, ...], k: int):
        lengths = np.array(lens, dtype=np.int64)
        keys = np.fromiter((_crc(n) for n in names), dtype=np.uint64, count=len(names))
        self.starts = np.cumsum(lengths) - lengths
        segment = np.repeat(np.arange(len(names)), lengths)
        pos = (np.arange(int(lengths.sum())) - self.starts[segment]).astype(np.float64)
        self.weights = _weights(pos, _consts(keys, k, 1)[segment])
        self.n, self.k = len(names), k

    def projections(self, flat: np.ndarray) -> np.ndarray:
        """float64 ``[n, k + 1]``: for each row-sum vector ``s_t`` (float64, laid end to
        end in ``flat``) ``[g_t,i . s_t for i < k]`` and ``|s_t|^2``."""
        out = np.empty((self.n, self.k + 1))
        out[:, :-1] = np.add.reduceat(self.weights * flat[:, None], self.starts, axis=0)
        out[:, -1] = np.add.reduceat(flat * flat, self.starts)
        return out


_ROW_LAYOUTS: dict[tuple, _RowLayout] = {}


def _row_projections(names: Sequence[str], rows: list[np.ndarray], k: int) -> np.ndarray:
    """``_RowLayout.projections`` of the (non-empty) row sums ``rows`` of ``names``."""
    key = (tuple(names), tuple(r.size for r in rows), k)
    lay = _ROW_LAYOUTS.get(key)
    if lay is None:
        if len(_ROW_LAYOUTS) >= 64:  # a rotation of shares per model
            _ROW_LAYOUTS.pop(next(iter(_ROW_LAYOUTS)))
        lay = _ROW_LAYOUTS[key] = _RowLayout(*key)
    return lay.projections(np.concatenate(rows) if len(rows) > 1 else rows[0])


class Packed:
    """Fingerprints as computed: ``sample`` (float64 ``[len(names), 2]``: checksum and
    ``|sample|^2`` of each name) and ``rows`` (float64 ``[len(full), k + 1]``: the row-sum
    projections and ``|row_sums|^2`` of the names digested in full). ``as_dict()``: by
    name (the module doc's lists); ``encode()`` / ``decode()``: a JSON-ready form whose
    numbers are base64 float64 bytes (a float's decimal repr costs ~1 us each way)."""

    def __init__(
        self, names: Sequence[str], sample: np.ndarray, full: Sequence[str], rows: np.ndarray
    ):
        self.names, self.sample, self.full, self.rows = list(names), sample, list(full), rows

    def as_dict(self) -> dict[str, list[float]]:
        try:
            out = dict(zip(self.names, self.sample.tolist()))
            for name, head in zip(self.full, self.rows.tolist()):
                out[name] = head + out[name]
        except (KeyError, TypeError):  # a name in full that is not in names, or not a str
            raise ValueError("malformed packed fingerprints: names do not match") from None
        return out

    def encode(self) -> dict:
        import base64

        return {
            "names": self.names,
            "sample": base64.b64encode(self.sample.tobytes()).decode(),
            "full": self.full,
            "rows": base64.b64encode(self.rows.tobytes()).decode(),
        }

    @classmethod
    def decode(cls, doc: Any) -> Packed:
        """The inverse of ``encode``; ``ValueError`` for anything else."""
        import base64
        import binascii

        try:
            names, full = doc["names"], doc["full"]
            sample = np.frombuffer(base64.b64decode(doc["sample"], validate=True), np.float64)
            rows = np.frombuffer(base64.b64decode(doc["rows"], validate=True), np.float64)
        except (TypeError, KeyError, binascii.Error) as e:
            raise ValueError(f"malformed packed fingerprints: {type(e).__name__}: {e}") from None
        except ValueError as e:  # a byte count that is not a multiple of 8
            raise ValueError(f"malformed packed fingerprints: {e}") from None
        if (
            not isinstance(names, list)
            or not isinstance(full, list)
            or sample.size != 2 * len(names)
            or (rows.size % len(full) if full else rows.size)
        ):  # (a name that is not a string is a name the reference does not have)
            raise ValueError("malformed packed fingerprints: names and numbers do not match")
        rows = rows.reshape(len(full), -1) if full else rows.reshape(0, 0)
        return cls(names, sample.reshape(-1, 2), full, rows)


def _pack(
    names: Sequence[str],
    flat: np.ndarray,
    counts: Sequence[int],
    full: list[tuple[str, np.ndarray]],
    k: int,
) -> Packed:
    """Fingerprints from the samples (float64, laid end to end in ``flat``; ``counts`` per
    name) and the row sums of the names in ``full``."""
    sample = _layout(names, counts).sample_parts(flat)
    fnames = [n for n, _ in full]
    rows = _row_projections(fnames, [r for _, r in full], k) if full else np.zeros((0, k + 1))
    return Packed(names, sample, fnames, rows)


class LiveFingerprints:
    """Fingerprints of tensors that stay where they are (a server's weights, which every
    loader updates in place): the sampled positions of each tensor are NumPy views taken
    once, so a fingerprint gathers all samples in one call (tensors on the CPU in float32,
    float64 or float16; others go through ``fingerprint_named``). Same numbers as
    ``fingerprint_named``."""

    def __init__(self, named: Mapping[str, torch.Tensor]):
        self.named = dict(named)
        self.names = list(self.named)
        self._views: list[np.ndarray] | None = None
        self._big = [n for n, t in self.named.items() if t.numel() > FULL_SAMPLE_MAX]
        if all(
            t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.is_contiguous()
            for t in self.named.values()
        ):
            views = []
            for name, t in self.named.items():
                flat = t.detach().reshape(-1).numpy()
                offset, stride, count = _sample_slice(name, flat.size)
                views.append(flat[offset : offset + stride * count : stride])
            self._views = views
            self._counts = [v.size for v in views]

    @torch.no_grad()
    def fingerprints(
        self, seed: int = 0, full: Collection[str] | None = None, k: int = DEFAULT_K
    ) -> dict[str, list[float]]:
        """Fingerprints by name, digested in full when the name is in ``full`` (``None``:
        all), else sample only (``seed``: see ``fingerprint_named``)."""
        if self._views is None:
            return fingerprint_named(self.named, seed, full=full, k=k)
        return self.packed(full, k).as_dict()

    @torch.no_grad()
    def packed(self, full: Collection[str] | None = None, k: int = DEFAULT_K) -> Packed:
        """``fingerprints`` as ``Packed``."""
        if self._views is None:
            digests = WeightDigests(full=full)
            digests.add(self.named.items())
            return digests.packed(k)
        flat = np.concatenate(self._views, dtype=np.float64) if self._views else np.zeros(0)
        rows = [
            (n, _row_sums(self.named[n].detach().reshape(-1)))
            for n in self._big
            if full is None or n in full
        ]
        return _pack(self.names, flat, self._counts, rows, k)


def fingerprint_tensor(
    name: str, t: torch.Tensor, seed: int = 0, k: int = DEFAULT_K, full: bool = True
) -> list[float]:
    """Fingerprint of ``t`` computed from the tensor itself."""
    return fingerprint_named([(name, t)], seed, k=k, full=None if full else ())[name]


def fingerprint_named(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    seed: int = 0,
    dtypes: Mapping[str, str] | None = None,
    k: int = DEFAULT_K,
    full: Collection[str] | None = None,
) -> dict[str, list[float]]:
    """Fingerprints by name, digested in full when the name is in ``full`` (``None``:
    all), else sample only; ``dtypes[name]`` (e.g. ``"bfloat16"``) casts a tensor first.
    ``seed`` names the check (requests and answers carry it); the numbers do not depend
    on it."""
    digests = WeightDigests(full=full, dtypes=dtypes)
    digests.add(named.items() if isinstance(named, Mapping) else named)
    return digests.fingerprints(seed, k)


class WeightDigests:
    """Digests of exported tensors, taken while they are gathered (trainer side).

    ``add(items)`` digests a bucket of ``(name, tensor)`` when ``enabled`` (e.g. only on
    the rank that answers): the samples of the whole bucket copied out in one call (one
    cast and one device copy for tensors NumPy cannot view), the row sums of the names in
    ``full`` (``None``: all), in ``dtypes[name]`` when given (the dtype the servers hold).
    ``views``: a dict the exporter keeps across exports whose tensors are its live
    parameters (the same memory at every export, e.g. a single CPU rank): the sampled
    positions of a bucket's tensors are looked up once and reused while the bucket's names
    and tensor addresses stay the same (the kept views hold those tensors, so an address
    cannot be reused by another tensor meanwhile). ``complete`` is set by the exporter once every tensor
    went through ``add``; ``fingerprints(seed)`` then answers without touching the weights
    again. ``seconds``: the time the digests took; ``counted``: set by the exporter once
    the rotation moved on to the next share."""

    def __init__(
        self,
        enabled: bool = True,
        full: Collection[str] | None = None,
        dtypes: Mapping[str, str] | None = None,
        views: dict[str, tuple] | None = None,
    ):
        self.enabled = bool(enabled)
        self.full = full
        self.dtypes = dict(dtypes or {})
        self._casts = {n: getattr(torch, d) for n, d in self.dtypes.items() if d}
        self._views = views
        self.names: list[str] = []
        self.counts: list[int] = []
        self._samples: list[np.ndarray] = []  # float64, one array per bucket
        self.rows: dict[str, np.ndarray] = {}  # float64 row sums of the names in full
        self.complete = False
        self.counted = False  # the rotation moved on past this export's share
        self.seconds = 0.0

    @torch.no_grad()
    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.enabled:
            return
        t0 = time.perf_counter()
        items = items if isinstance(items, list) else list(items)
        full, casts, views = self.full, self._casts, self._views
        plan = key = ptrs = None
        if views is not None and not casts:
            # the same tensors (addresses) as at the last export of this bucket: its views
            key = tuple(name for name, _ in items)
            ptrs = [t.data_ptr() for _, t in items]
            plan = views.get(key)
            if plan is not None and plan[0] == ptrs:
                _, parts, counts, big = plan
                self.names.extend(key)
                self.counts.extend(counts)
                for i in big:
                    name, t = items[i]
                    if full is None or name in full:
                        self.rows[name] = _row_sums(t.detach().reshape(-1))
                self._samples.append(np.concatenate(parts, dtype=np.float64))
                self.seconds += time.perf_counter() - t0
                return
        parts: list[np.ndarray | None] = []
        moved: list[tuple[int, torch.Tensor]] = []  # pieces to cast / copy to the CPU
        big: list[int] = []
        for name, t in items:
            n = t.numel()
            self.names.append(name)
            offset, stride, count = _sample_slice(name, n)
            dt = casts.get(name) if casts else None
            self.counts.append(count)
            if n > FULL_SAMPLE_MAX:
                big.append(len(parts))
            if dt is None and t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES:
                # a NumPy view: the strided pick costs ~1 us instead of a few torch calls
                parts.append(
                    t.detach().numpy().reshape(-1)[offset : offset + stride * count : stride]
                )
            else:
                flat = t.detach().reshape(-1)
                piece = flat[offset : offset + stride * count : stride]
                moved.append((len(parts), piece if dt is None else piece.to(dt)))
                parts.append(None)
            if n > FULL_SAMPLE_MAX and (full is None or name in full):
                flat = t.detach().reshape(-1)
                self.rows[name] = _row_sums(flat if dt is None else flat.to(dt))
        if moved:  # one cast + one copy for all of them (e.g. from the GPU)
            pieces = [p for _, p in moved]
            if len({p.dtype for p in pieces}) > 1:
                pieces = [p.to(torch.float64) for p in pieces]
            cpu = torch.cat(pieces).to("cpu", torch.float64).numpy()
            split = np.split(cpu, np.cumsum([p.numel() for p in pieces])[:-1])
            for (i, _), arr in zip(moved, split):
                parts[i] = arr
        if parts:  # copied out now: the tensors may be the live parameters
            self._samples.append(np.concatenate(parts, dtype=np.float64))
        if key is not None:
            if moved or not all(t.is_contiguous() for _, t in items):
                views.pop(key, None)
            else:  # kept until the addresses change (then the old tensors are let go)
                views[key] = (ptrs, parts, self.counts[-len(items) :], big)
        self.seconds += time.perf_counter() - t0

    def fingerprints(self, seed: int = 0, k: int = DEFAULT_K) -> dict[str, list[float]]:
        """Fingerprints by name (``seed``: see ``fingerprint_named``)."""
        return self.packed(k).as_dict()

    def packed(self, k: int = DEFAULT_K) -> Packed:
        """The fingerprints of what went through ``add``, as ``Packed``."""
        t0 = time.perf_counter()
        if len(self._samples) == 1:
            flat = self._samples[0]
        else:
            flat = np.concatenate(self._samples) if self._samples else np.zeros(0)
        rows = [(n, self.rows[n]) for n in self.names if n in self.rows]
        out = _pack(self.names, flat, self.counts, rows, k)
        self.seconds += time.perf_counter() - t0
        return out


#: Written by the trainer into a weight-update directory when verification is on
#: (``write_reference``): the seed, the names digested in full and the trainer's
#: fingerprints. A built-in server that loads the directory digests its live weights with
#: that seed and returns its fingerprints in the update response; the verifying hook reads
#: the reference from here (no extra request to the trainer or the servers). Two lines of
#: JSON: ``{"seed", "full"[, "deferred"][, "error"]}`` (all a server reads) and, unless
#: deferred, ``{name: fingerprint}``.
REFERENCE_FILE = "weights_fingerprint.json"


def write_reference(path: str, seed: int, digests: WeightDigests, atomic: bool = False) -> dict:
    """Write ``path/REFERENCE_FILE`` with ``seed``, the names ``digests`` holds in full and
    their fingerprints for ``seed``; returns what was written. ``atomic``: through a
    temporary file (replacing a request that a reader may be polling)."""
    head = {"seed": int(seed), "full": sorted(digests.rows)}
    packed = digests.packed()
    _write(path, head, packed.encode(), atomic)
    return {**head, "fingerprints": packed.as_dict()}


def write_request(path: str, seed: int, full: Sequence[str]) -> dict:
    """Write ``path/REFERENCE_FILE`` with ``seed`` and the names to digest in full but no
    fingerprints yet (``"deferred": true``): what a server needs; the trainer digests its
    export later (``FSDPEngine._finish_reference``), off the sync's path."""
    head = {"seed": int(seed), "full": list(full), "deferred": True}
    _write(path, head, None)
    return {**head, "fingerprints": {}}


def write_error(path: str, seed: int, error: str) -> None:
    """Replace a request in ``path`` by a reference that says why the trainer's digests
    failed (``"error"``; the verifying hook raises it)."""
    _write(path, {"seed": int(seed), "full": [], "error": str(error)}, None, atomic=True)


def _write(path: str, head: dict, fingerprints: dict | None, atomic: bool = False) -> None:
    """Write ``path/REFERENCE_FILE`` (``REFERENCE_FILE`` doc): directly (the exporter
    removed any earlier one and nobody reads it before the save returns; a new file costs
    ~50 us, replacing one by a rename ~300 us on ext4, which flushes a file renamed over
    another) or, with ``atomic``, through a temporary file."""
    import json
    import os

    text = json.dumps(head) + "\n"  # the C encoder (json.dump streams through Python's)
    if fingerprints is not None:
        text += json.dumps(fingerprints) + "\n"
    final = os.path.join(path, REFERENCE_FILE)
    tmp = os.path.join(path, f".{REFERENCE_FILE}.tmp")
    with open(tmp if atomic else final, "w") as f:
        f.write(text)
    if atomic:
        os.replace(tmp, final)


def _read(path: str, head_only: bool) -> dict | None:
    import json
    import os

    f = os.path.join(path, REFERENCE_FILE)
    try:
        with open(f, "rb") as fh:
            doc = json.loads(fh.readline())
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            if not head_only and "fingerprints" not in doc:
                rest = fh.readline()
                doc["fingerprints"] = (
                    Packed.decode(json.loads(rest)).as_dict() if rest.strip() else {}
                )
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable weight fingerprint reference {f}: {e}") from None
    seed, full = doc.get("seed"), doc.get("full")
    if (
        not isinstance(seed, int)
        or isinstance(seed, bool)
        or not 0 <= seed < 2**62
        or not isinstance(full, list)
        or not all(isinstance(n, str) for n in full)
        or not (head_only or isinstance(doc.get("fingerprints"), dict))
    ):
        raise ValueError(f"malformed weight fingerprint reference {f}")
    return doc


def read_request(path: str) -> tuple[int, list[str]] | None:
    """``(seed, full)`` of ``path/REFERENCE_FILE`` (its first line only), ``None`` when
    there is none; raises ``ValueError`` for a malformed one."""
    doc = _read(path, head_only=True)
    return None if doc is None else (doc["seed"], doc["full"])


def read_reference(path: str) -> dict | None:
    """The reference written by ``write_reference`` (or ``write_request``) into ``path``:
    ``{"seed", "full", "fingerprints"[, "deferred"][, "error"]}`` (``None``: no file);
    ``ValueError`` when it is malformed."""
    return _read(path, head_only=False)


def compare_fingerprints(
    reference: Mapping[str, list[float]],
    got: Mapping[str, list[float]],
    rtol: float = RTOL,
    sample_rtol: float = SAMPLE_RTOL,
) -> list[str]:
    """Names of the tensors of ``reference`` that ``got`` lacks or whose fingerprint differs
    (with how much), in reference order; names only ``got`` has are ignored (e.g. a tied
    ``lm_head.weight``). A sample-only reference is compared on the sample part; the sample
    checksum must be equal, the rest within the tolerances."""
    bad = []
    for name, ref in reference.items():
        fp = got.get(name)
        if fp == ref:  # the usual case: the same numbers
            continue
        if fp is None:
            bad.append(f"{name} (missing on the server)")
            continue
        if (len(fp) != len(ref) and len(ref) != 2) or len(ref) == 3 or len(fp) < 2:
            bad.append(f"{name} (fingerprint of length {len(fp)}, expected {len(ref)})")
            continue
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in fp):
            bad.append(f"{name} (malformed fingerprint from the server: {str(fp)[:80]})")
            continue
        if len(ref) > 2:  # row sums: every element counts
            k = len(ref) - 3
            s_sq = max(ref[k], 0.0)
            scale = math.sqrt(s_sq) + 1e-30  # |row_sums|: the std of a projection
            d_proj = max(abs(a - b) for a, b in zip(ref[:k], fp[:k]))
            if d_proj > rtol * scale or abs(s_sq - fp[k]) > 4 * rtol * (s_sq + 1e-30):
                bad.append(
                    f"{name} (row-sum projection differs by {d_proj:.3g}, |sums| {scale:.3g})"
                )
                continue
        (c_ref, x_sq), (c_got, x_got) = ref[-2:], fp[-2:]
        x_sq = max(x_sq, 0.0)
        if c_ref != c_got or abs(x_sq - x_got) > 4 * sample_rtol * (x_sq + 1e-30):
            bad.append(
                f"{name} (sampled elements differ: checksum {c_got:.0f}, expected "
                f"{c_ref:.0f}; |sample| {math.sqrt(max(x_got, 0.0)):.6g}, expected "
                f"{math.sqrt(x_sq):.6g})"
            )
    return bad
