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

The *fingerprint* for a ``seed`` is computed from the digest alone::

    full:         [g_1 . row_sums, ..., g_k . row_sums, |row_sums|^2, h . sample, |sample|^2]
    sample only:  [h . sample, |sample|^2]

with pseudo-random weights ``g_i``, ``h`` drawn from the seed and the tensor's name. Any
change ``delta`` of one element of a full digest moves each projection by about
``|delta|`` (k independent chances), far above the round-off of float32 row sums (``RTOL``
of ``|row_sums|``, e.g. CPU vs GPU kernels); the sample part is exact (float64 of the
held values) and compared with ``SAMPLE_RTOL``. Both sides work on the tensor in the
dtype the server holds.

The trainer digests each tensor as it gathers it for the export (``FSDPEngine``,
``WeightDigests``); the built-in server digests its live tensors when asked
(``POST /weights_fingerprint``, with the names to digest in full). The seeded projections
cost a few microseconds per tensor. Used by ``areal.infra.weight_verify``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence

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
#: Relative tolerance (of |sample|) of the sample part: exact values, float64 dot products.
SAMPLE_RTOL = 1e-9


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


@dataclasses.dataclass
class TensorDigest:
    """Seed-free summary of one tensor: float64 CPU ``sample`` and, for a full digest,
    ``row_sums`` (``None``: sample only)."""

    sample: torch.Tensor
    row_sums: torch.Tensor | None = None


def _sample_slice(name: str, n: int) -> tuple[int, int, int]:
    """(offset, stride, count) of the sampled elements of a tensor of ``n`` elements."""
    if n <= FULL_SAMPLE_MAX:
        return 0, 1, n
    stride = n // SAMPLE
    offset = zlib.crc32(name.encode()) % stride
    return offset, stride, SAMPLE


@torch.no_grad()
def tensor_sample(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sampled elements of ``t`` (see the module doc), float64 on the CPU; ``dtype``:
    the values ``t`` would have in that dtype (only the sample is cast)."""
    flat = t.detach().reshape(-1)
    offset, stride, count = _sample_slice(name, flat.numel())
    s = flat[offset : offset + stride * count : stride]
    if dtype is not None:
        s = s.to(dtype)
    return s.to("cpu", torch.float64)


@torch.no_grad()
def digest_tensor(
    name: str, t: torch.Tensor, full: bool = True, dtype: torch.dtype | None = None
) -> TensorDigest:
    """Digest of ``t`` (module doc), cast to ``dtype`` first when given. ``full=False``:
    the sample only. A tensor of at most ``FULL_SAMPLE_MAX`` elements is sampled whole,
    so its sample is already exact in every element and it never gets row sums."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    sample = tensor_sample(name, flat, dtype)
    if not full or n <= FULL_SAMPLE_MAX:
        return TensorDigest(sample)
    return TensorDigest(sample, _row_sums(flat if dtype is None else flat.to(dtype)))


def _row_sums(flat: torch.Tensor) -> torch.Tensor:
    """float64 CPU row sums (module doc) of a flat tensor of more than ``ROW`` elements."""
    n = flat.numel()
    whole = n // ROW
    row_sums = flat[: whole * ROW].view(whole, ROW).sum(1, dtype=torch.float32)
    if n > whole * ROW:  # the short last row
        tail = flat[whole * ROW :].sum(dtype=torch.float32).reshape(1)
        row_sums = torch.cat([row_sums, tail])
    row_sums = row_sums.to("cpu", torch.float64)
    group = _group(n)
    if group > 1:  # consecutive rows summed (float64) so that at most MAX_SUMS remain
        pad = -row_sums.numel() % group
        row_sums = torch.nn.functional.pad(row_sums, (0, pad)).view(-1, group).sum(1)
    return row_sums


def _group(n: int) -> int:
    """Rows summed together in the digest of a tensor of ``n`` elements."""
    return max(1, math.ceil(math.ceil(n / ROW) / MAX_SUMS))


def rotation_share(sizes: Sequence[tuple[str, int]], every: int, index: int) -> set[str]:
    """Names whose row sums are taken at check number ``index``: the tensors of more than
    ``FULL_SAMPLE_MAX`` elements (``sizes``: ``(name, numel)``) are split into ``every``
    groups of about equal size (largest first, each into the smallest group so far; ties
    by name, so the split depends only on ``sizes``) and group ``index % every`` is taken.
    Over ``every`` consecutive checks every tensor is digested in full once."""
    if every <= 1:
        return {name for name, n in sizes if n > FULL_SAMPLE_MAX}
    groups = [0] * every
    share: set[str] = set()
    for name, n in sorted(sizes, key=lambda s: (-s[1], s[0])):
        if n <= FULL_SAMPLE_MAX:
            continue
        g = min(range(every), key=lambda i: (groups[i], i))
        groups[g] += n
        if g == index % every:
            share.add(name)
    return share


_M64 = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser (Python ints): per-tensor constants from (seed, name, i)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _weights(pos: np.ndarray, consts: np.ndarray) -> np.ndarray:
    """Pseudo-random weights ``+-[0.5, 1)`` (float64 ``[N, m]``) of element ``pos``
    (float64 ``[N]``) for each constant pair (``consts``: float64 ``[N, m, 2]`` in
    ``[0, 1)``): a Weyl sequence ``frac(pos * a + b)`` with a random step ``a`` in
    ``[0.5, 1)`` per tensor, seed and projection. Plain IEEE arithmetic, so other machines
    draw the same to round-off; no weight is near zero, so one changed element moves every
    projection by at least half its change."""
    u = pos[:, None] * (0.5 + 0.5 * consts[..., 0]) + consts[..., 1]
    u -= np.floor(u)
    return np.where(u < 0.5, -0.5 - u, u)


def _consts(names: list[str], seed: int, m: int, salt: int) -> np.ndarray:
    """float64 ``[len(names), m, 2]`` constants in ``[0, 1)`` for ``(seed, name, salt)``:
    one splitmix64 draw per name, spread over the ``2m`` constants by irrational steps."""
    base = np.array(
        [_mix((seed * 1_000_003 + zlib.crc32(n.encode())) ^ (salt << 56)) >> 11 for n in names],
        dtype=np.float64,
    ) / (2.0**53)
    j = np.arange(1, 2 * m + 1, dtype=np.float64)
    c = base[:, None] * (1.0 + 0.7548776662466927 * j) + 0.5698402909980532 * j
    c -= np.floor(c)
    return c.reshape(len(names), m, 2)


def _segment_projections(
    vectors: list[np.ndarray], consts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each vector v_t (float64): ``[w_t,i . v_t for i < m]`` and ``v_t . v_t``."""
    lengths = np.fromiter((v.size for v in vectors), dtype=np.int64, count=len(vectors))
    flat = np.concatenate(vectors) if vectors else np.zeros(0)
    return _flat_projections(flat, lengths, consts)


def _flat_projections(
    flat: np.ndarray, lengths: np.ndarray, consts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``_segment_projections`` of the vectors laid end to end in ``flat`` (float64) with
    ``lengths``: all at once (weights drawn per element, segment sums; NumPy, a few
    microseconds per operation, where most of the cost on small models is per call)."""
    n_t, m = len(lengths), consts.shape[1]
    proj = np.zeros((n_t, m))
    sq = np.zeros(n_t)
    keep = np.flatnonzero(lengths)  # reduceat needs non-empty segments
    if keep.size == 0:
        return proj, sq
    lens = lengths[keep]
    starts = np.cumsum(lens) - lens
    pos = (np.arange(flat.size) - np.repeat(starts, lens)).astype(np.float64)
    w = _weights(pos, np.repeat(consts[keep], lens, axis=0))
    proj[keep] = np.add.reduceat(w * flat[:, None], starts, axis=0)
    sq[keep] = np.add.reduceat(flat * flat, starts)
    return proj, sq


def _assemble(
    names: list[str],
    flat: np.ndarray,
    lengths: np.ndarray,
    full: list[tuple[str, np.ndarray]],
    seed: int,
    k: int,
) -> dict[str, list[float]]:
    """Fingerprints from the samples (laid end to end in ``flat``) and the row sums of the
    names in ``full``."""
    q, x_sq = _flat_projections(flat, lengths, _consts(names, seed, 1, 2))
    out = dict(zip(names, np.concatenate([q, x_sq[:, None]], axis=1).tolist()))
    if full:
        fnames = [n for n, _ in full]
        proj, s_sq = _segment_projections([r for _, r in full], _consts(fnames, seed, k, 1))
        for name, head in zip(fnames, np.concatenate([proj, s_sq[:, None]], axis=1).tolist()):
            out[name] = head + out[name]
    return out


@torch.no_grad()
def fingerprint_digests(
    digests: Mapping[str, TensorDigest] | Iterable[tuple[str, TensorDigest]],
    seed: int = 0,
    k: int = DEFAULT_K,
) -> dict[str, list[float]]:
    """Fingerprints (module doc: ``k + 3`` numbers for a full digest, 2 for a sample) of
    many digests at once: a few vectorised operations whatever the number of tensors."""
    items = list(digests.items() if isinstance(digests, Mapping) else digests)
    if not items:
        return {}
    samples = [d.sample.numpy() for _, d in items]
    lengths = np.fromiter((v.size for v in samples), dtype=np.int64, count=len(samples))
    full = [(n, d.row_sums.numpy()) for n, d in items if d.row_sums is not None]
    return _assemble([n for n, _ in items], np.concatenate(samples), lengths, full, seed, k)


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
            self._lengths = np.array([v.size for v in views], dtype=np.int64)

    @torch.no_grad()
    def fingerprints(
        self, seed: int = 0, full: Collection[str] | None = None, k: int = DEFAULT_K
    ) -> dict[str, list[float]]:
        """Fingerprints by name, digested in full when the name is in ``full`` (``None``:
        all), else sample only."""
        if self._views is None:
            return fingerprint_named(self.named, seed, full=full, k=k)
        if not self.names:
            return {}
        flat = np.concatenate(self._views).astype(np.float64)
        rows = [
            (n, _row_sums(t.detach().reshape(-1)).numpy())
            for n, t in self.named.items()
            if t.numel() > FULL_SAMPLE_MAX and (full is None or n in full)
        ]
        return _assemble(self.names, flat, self._lengths, rows, seed, k)


def fingerprint_tensor(
    name: str, t: torch.Tensor, seed: int = 0, k: int = DEFAULT_K, full: bool = True
) -> list[float]:
    """Fingerprint of ``t`` computed from the tensor itself."""
    return fingerprint_digests([(name, digest_tensor(name, t, full))], seed, k)[name]


def fingerprint_named(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    seed: int = 0,
    dtypes: Mapping[str, str] | None = None,
    k: int = DEFAULT_K,
    full: Collection[str] | None = None,
) -> dict[str, list[float]]:
    """Fingerprints by name, digested in full when the name is in ``full`` (``None``:
    all), else sample only; ``dtypes[name]`` (e.g. ``"bfloat16"``) casts a tensor first."""
    digests = WeightDigests(full=full, dtypes=dtypes)
    digests.add(named.items() if isinstance(named, Mapping) else named)
    return digests.fingerprints(seed, k)


class WeightDigests:
    """Digests of exported tensors, taken while they are gathered (trainer side).

    ``add(items)`` digests a bucket of ``(name, tensor)`` when ``enabled`` (e.g. only on
    the rank that answers): the samples of the whole bucket in one gather and one copy,
    the row sums of the names in ``full`` (``None``: all), in ``dtypes[name]`` when given
    (the dtype the servers hold). ``complete`` is set by the exporter once every tensor
    went through ``add``; ``fingerprints(seed)`` then answers without touching the
    weights again. ``seconds``: the time the digests took; ``counted``: set by the
    exporter once the rotation moved on to the next share."""

    def __init__(
        self,
        enabled: bool = True,
        full: Collection[str] | None = None,
        dtypes: Mapping[str, str] | None = None,
    ):
        self.enabled = bool(enabled)
        self.full = full
        self.dtypes = dict(dtypes or {})
        self.digests: dict[str, TensorDigest] = {}
        self.complete = False
        self.counted = False  # the rotation moved on past this export's share
        self.seconds = 0.0

    @torch.no_grad()
    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.enabled:
            return
        t0 = time.perf_counter()
        names: list[str] = []
        samples: list[np.ndarray | None] = []
        moved: list[tuple[int, torch.Tensor]] = []  # pieces to cast / copy to the CPU
        sums: dict[str, torch.Tensor] = {}
        for name, t in items:
            flat = t.detach().reshape(-1)
            n = flat.numel()
            dt = self.dtypes.get(name)
            dt = getattr(torch, dt) if dt else None
            offset, stride, count = _sample_slice(name, n)
            names.append(name)
            if dt is None and flat.device.type == "cpu" and flat.dtype in _NUMPY_DTYPES:
                # a NumPy view: the strided pick costs ~1 us instead of a few torch calls
                samples.append(
                    flat.numpy()[offset : offset + stride * count : stride].astype(np.float64)
                )
            else:
                piece = flat[offset : offset + stride * count : stride]
                moved.append((len(samples), piece if dt is None else piece.to(dt)))
                samples.append(None)
            if n > FULL_SAMPLE_MAX and (self.full is None or name in self.full):
                sums[name] = _row_sums(flat if dt is None else flat.to(dt))
        if moved:  # one cast + one copy for all of them (e.g. from the GPU)
            pieces = [p for _, p in moved]
            if len({p.dtype for p in pieces}) > 1:
                pieces = [p.to(torch.float64) for p in pieces]
            cpu = torch.cat(pieces).to("cpu", torch.float64).numpy()
            split = np.split(cpu, np.cumsum([p.numel() for p in pieces])[:-1])
            for (i, _), arr in zip(moved, split):
                samples[i] = arr
        for name, sample in zip(names, samples):
            self.digests[name] = TensorDigest(torch.from_numpy(sample), sums.get(name))
        self.seconds += time.perf_counter() - t0

    def fingerprints(self, seed: int = 0, k: int = DEFAULT_K) -> dict[str, list[float]]:
        return fingerprint_digests(self.digests, seed, k)


#: Written by the trainer into a weight-update directory when verification is on
#: (``write_reference``): the seed, the names digested in full and the trainer's
#: fingerprints. A built-in server that loads the directory digests its live weights with
#: that seed and returns its fingerprints in the update response; the verifying hook reads
#: the reference from here (no extra request to the trainer or the servers).
REFERENCE_FILE = "weights_fingerprint.json"


def write_reference(path: str, seed: int, digests: WeightDigests) -> dict:
    """Write ``path/REFERENCE_FILE`` (atomically) with ``seed``, the names ``digests`` holds
    in full and their fingerprints for ``seed``; returns what was written."""
    doc = {
        "seed": int(seed),
        "full": sorted(n for n, d in digests.digests.items() if d.row_sums is not None),
        "fingerprints": digests.fingerprints(seed),
    }
    _write_json(path, doc)
    return doc


def write_request(path: str, seed: int, full: Sequence[str]) -> dict:
    """Write ``path/REFERENCE_FILE`` (atomically) with ``seed`` and the names to digest in
    full but no fingerprints yet (``"deferred": true``): what a server needs; the trainer
    digests its export later (``FSDPEngine.fingerprint_reference``), off the sync's path."""
    doc = {"seed": int(seed), "full": list(full), "fingerprints": {}, "deferred": True}
    _write_json(path, doc)
    return doc


def _write_json(path: str, doc: dict) -> None:
    import json
    import os

    tmp = os.path.join(path, f".{REFERENCE_FILE}.tmp")
    text = json.dumps(doc)  # the C encoder (json.dump streams through the Python one)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(path, REFERENCE_FILE))


def read_request(path: str) -> tuple[int, list[str]] | None:
    """``(seed, full)`` of ``path/REFERENCE_FILE``, ``None`` when there is none; raises
    ``ValueError`` for a malformed one."""
    doc = read_reference(path)
    return None if doc is None else (doc["seed"], doc["full"])


def read_reference(path: str) -> dict | None:
    """The reference written by ``write_reference`` into ``path`` (``None``: no file);
    ``ValueError`` when it is malformed."""
    import json
    import os

    f = os.path.join(path, REFERENCE_FILE)
    try:
        with open(f) as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"unreadable weight fingerprint reference {f}: {e}") from None
    seed, full, fps = doc.get("seed"), doc.get("full"), doc.get("fingerprints")
    if (
        not isinstance(seed, int)
        or isinstance(seed, bool)
        or not 0 <= seed < 2**62
        or not isinstance(full, list)
        or not all(isinstance(n, str) for n in full)
        or not isinstance(fps, dict)
    ):
        raise ValueError(f"malformed weight fingerprint reference {f}")
    return doc


def compare_fingerprints(
    reference: Mapping[str, list[float]],
    got: Mapping[str, list[float]],
    rtol: float = RTOL,
    sample_rtol: float = SAMPLE_RTOL,
) -> list[str]:
    """Names of the tensors of ``reference`` that ``got`` lacks or whose fingerprint differs
    (with how much), in reference order; names only ``got`` has are ignored (e.g. a tied
    ``lm_head.weight``). A sample-only reference is compared on the sample part."""
    bad = []
    for name, ref in reference.items():
        fp = got.get(name)
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
        (q_ref, x_sq), (q_got, x_got) = ref[-2:], fp[-2:]
        x_sq = max(x_sq, 0.0)
        x_scale = math.sqrt(x_sq) + 1e-30
        d_sample = abs(q_ref - q_got)
        if d_sample > sample_rtol * x_scale or abs(x_sq - x_got) > 4 * sample_rtol * (x_sq + 1e-30):
            bad.append(
                f"{name} (sampled elements differ: projection by {d_sample:.3g}, "
                f"|sample| {x_scale:.3g})"
            )
    return bad
