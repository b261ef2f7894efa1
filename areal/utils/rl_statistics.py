"""Statistics over RL batches: KL estimators, per-sequence reductions, normalisation.

Per-token tensors are padded ``[B, T]`` or packed 1-D ``[n_tokens]`` with ``cu_seqlens``
(see the shared tensor conventions). Normalisation (:func:`group_normalization`,
:func:`masked_normalization`) all-reduces its sums over a data-parallel group when
``torch.distributed`` runs, so every rank sees the global batch statistics.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

KL_ESTIMATORS = ("k1", "k2", "k3")
NORM_LEVELS = ("batch", "group", None)


# ------------------------------------------------------------------------ KL estimators
def kl_estimator(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With ``log r = ref_logp - logp``: ``k1 = -log r``, ``k2 = (log r)^2 / 2``,
    ``k3 = (r - 1) - log r`` (unbiased and non-negative).
    """
    log_ratio = logp.float() - ref_logp.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        neg = -log_ratio
        return torch.expm1(neg) - neg
    raise ValueError(f"kl_estimator={kind!r}; allowed: {list(KL_ESTIMATORS)}")


# ---------------------------------------------------------------- sequence reductions
def sequence_index(cu_seqlens: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """For packed tokens, the sequence id of every token: ``[0,0,0,1,1,2,...]``."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(seqlens.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(ids, seqlens, output_size=n_tokens)


def sequence_sum(
    x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Per-sequence masked sums ``[n_seqs]`` (packed 1-D with cu_seqlens, or padded 2-D)."""
    xm = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if x.dim() == 2:
        return xm.sum(-1)
    if cu_seqlens is None:
        raise ValueError("cu_seqlens is required for packed 1-D tensors")
    idx = sequence_index(cu_seqlens, x.numel())
    out = torch.zeros(cu_seqlens.numel() - 1, dtype=x.dtype, device=x.device)
    return out.index_add(0, idx, xm)


def broadcast_to_tokens(
    v: torch.Tensor, like: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Per-sequence values ``[n_seqs]`` spread over the tokens of ``like`` (padded or packed)."""
    if like.dim() == 2:
        return v.unsqueeze(-1).expand_as(like)
    return v[sequence_index(cu_seqlens, like.numel())]


def sequence_mean(
    x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked mean of each sequence ``[n_seqs]`` (0 for sequences with no masked token)."""
    mask = mask.bool()
    n = sequence_sum(mask.to(x.dtype), mask, cu_seqlens)
    return sequence_sum(x, mask, cu_seqlens) / n.clamp(min=1)


def sequence_reduce(
    x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, how: str
) -> torch.Tensor:
    """Per-sequence ``sum`` / ``mean`` / ``max`` of ``x`` over ``mask`` (0 for empty sequences)."""
    if how == "sum":
        return sequence_sum(x, mask, cu_seqlens)
    if how == "mean":
        return sequence_mean(x, mask, cu_seqlens)
    neg_inf = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    xm = torch.where(mask, x, neg_inf)
    if x.dim() == 2:
        out = xm.amax(-1)
    else:
        idx = sequence_index(cu_seqlens, x.numel())
        out = torch.full((cu_seqlens.numel() - 1,), float("-inf"), dtype=x.dtype, device=x.device)
        out = out.scatter_reduce(0, idx, xm, reduce="amax")
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)


# ------------------------------------------------------------------------ normalisation
def _all_reduce_sum(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


@torch.no_grad()
def masked_normalization(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    dim: int | tuple[int, ...] | None = None,
    unbiased: bool = False,
    eps: float = 1e-5,
    high_precision: bool = True,
    all_reduce: bool = True,
    reduce_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (reduced across ranks if asked).

    ``dim=None`` normalises over all dims. With ``all_reduce`` and an initialised
    ``torch.distributed``, sums are all-reduced over ``reduce_group`` (global batch statistics).
    Masked-out entries are returned as 0.
    """
    return group_normalization(
        x,
        mask,
        mean_level="batch",
        std_level="batch",
        dim=dim,
        std_unbiased=unbiased,
        eps=eps,
        high_precision=high_precision,
        reduce_group=reduce_group if all_reduce else None,
        all_reduce=all_reduce,
    )


def episode_first_rows(episode_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, episode_of_row)`` for ``episode_ids`` ``[B]``: ``first[e]`` is the first
    row (in batch order) of episode ``e`` (episodes numbered in ascending id order) and
    ``episode_of_row[i]`` the episode of row ``i``. No per-element host syncs."""
    ids = torch.as_tensor(episode_ids).reshape(-1)
    _, ep_of_row = torch.unique(ids, return_inverse=True)
    n = int(ep_of_row.max()) + 1 if ep_of_row.numel() else 0
    rows = torch.arange(ids.numel(), device=ids.device)
    first = torch.full((n,), ids.numel(), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, ep_of_row, rows, reduce="amin")
    return first, ep_of_row


def regular_group_size(
    group_ids: torch.Tensor, episode_ids: torch.Tensor | None = None
) -> int | None:
    """The group size when ``group_ids`` ``[B]`` describe the fixed layout (contiguous
    groups of one size, one row per episode: ``episode_ids`` all distinct or ``None``),
    else ``None``. A few host syncs per batch."""
    g = torch.as_tensor(group_ids).reshape(-1)
    if episode_ids is not None:
        ep = torch.as_tensor(episode_ids).reshape(-1)
        if ep.numel() != g.numel():
            raise ValueError(f"episode_ids has {ep.numel()} rows, group_ids {g.numel()}")
        if torch.unique(ep).numel() != ep.numel():
            return None
    if g.numel() == 0:
        return None
    starts = torch.ones_like(g, dtype=torch.bool)
    starts[1:] = g[1:] != g[:-1]
    n_runs = int(starts.sum())
    if g.numel() % n_runs != 0:
        return None
    runs = g.reshape(n_runs, -1)
    if not bool((runs == runs[:, :1]).all()) or torch.unique(runs[:, 0]).numel() != n_runs:
        return None
    return runs.shape[1]


@dataclasses.dataclass
class _NormUnits:
    """The statistics units of one :func:`group_normalization` call: its values ``xd``
    and mask ``m`` (high precision), episodes (``first``: episode -> its first row,
    ``ep_of_row``: row -> its episode) or rows, groups by id or by ``group_size``."""

    xd: torch.Tensor
    m: torch.Tensor
    first: torch.Tensor | None
    ep_of_row: torch.Tensor | None
    group_ids: torch.Tensor | None
    group_size: int
    dim: int | tuple[int, ...] | None
    reduce_group: dist.ProcessGroup | None

    def unit_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sum, sumsq, count) per statistics unit: episodes (their first row) or rows."""
        if self.first is not None:
            v, mv = self.xd[self.first], self.m[self.first]
            return v, v.square(), mv
        rows = self.xd.shape[0]
        flat, mflat = self.xd.reshape(rows, -1), self.m.reshape(rows, -1)
        return flat.sum(1), flat.square().sum(1), mflat.sum(1)

    def stats(self, level: str, all_reduce: bool) -> tuple[torch.Tensor, ...]:
        """Broadcastable (sum, sumsq, count) for a level."""
        xd, m = self.xd, self.m
        if level == "group" and self.group_ids is None and self.first is not None:
            raise ValueError("episode_ids without group_ids cannot form groups")
        if level == "group" and self.group_ids is not None:
            return self._by_group_id()
        if level == "group":
            return self._by_group_size()
        if self.first is not None:  # every episode once
            v, vsq, mv = self.unit_stats()
            s, sq, c = (t.sum().reshape(1) for t in (v, vsq, mv))  # x is [B]
        else:
            dims = tuple(range(xd.dim())) if self.dim is None else self.dim
            s = xd.sum(dims, keepdim=True)
            sq = xd.square().sum(dims, keepdim=True)
            c = m.sum(dims, keepdim=True)
        if all_reduce:
            _all_reduce_sum([s, sq, c], self.reduce_group)
        return s, sq, c

    def _expand(self) -> tuple[int, ...]:
        return (self.xd.shape[0], *([1] * (self.xd.dim() - 1)))

    def _by_group_id(self) -> tuple[torch.Tensor, ...]:
        _, g_of_row = torch.unique(self.group_ids, return_inverse=True)
        n_groups = int(g_of_row.max()) + 1 if g_of_row.numel() else 0
        owner = g_of_row
        if self.first is not None:
            owner = g_of_row[self.first]
            if not torch.equal(owner[self.ep_of_row], g_of_row):
                raise ValueError("rows of one episode carry different group_ids")
        out = []
        for u in self.unit_stats():
            acc = torch.zeros(n_groups, dtype=self.xd.dtype, device=self.xd.device)
            out.append(acc.index_add_(0, owner, u)[g_of_row].reshape(self._expand()))
        return out[0], out[1], out[2]

    def _by_group_size(self) -> tuple[torch.Tensor, ...]:
        xd, m, gs = self.xd, self.m, self.group_size
        if xd.shape[0] % gs != 0:
            raise ValueError(f"group_size={gs} does not divide the batch size {xd.shape[0]}")
        shape = (xd.shape[0] // gs, gs, *xd.shape[1:])
        xg, mg = xd.reshape(shape), m.reshape(shape)
        dims = tuple(range(1, xg.dim()))
        sums = (xg.sum(dims, keepdim=True), xg.square().sum(dims, keepdim=True))
        count = mg.sum(dims, keepdim=True)
        expand = self._expand()
        return tuple(t.repeat_interleave(gs, 0).reshape(expand) for t in (*sums, count))


@torch.no_grad()
def group_normalization(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    mean_level: str | None = "batch",
    std_level: str | None = "batch",
    group_size: int = 1,
    mean_leave1out: bool = False,
    std_unbiased: bool = True,
    eps: float = 1e-5,
    dim: int | tuple[int, ...] | None = None,
    high_precision: bool = True,
    reduce_group: dist.ProcessGroup | None = None,
    all_reduce: bool = True,
    group_ids: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """NormConfig-style normalisation of rewards ``[B]`` or advantages ``[B, T]``.

    * ``mean_level``: ``"batch"`` (subtract the batch mean, all-reduced across ranks),
      ``"group"`` (mean over each group), or ``None``.
    * ``std_level``: same levels for the divisor; ``None`` leaves the scale (Dr.GRPO).
    * ``mean_leave1out``: each entry's mean excludes the entry itself (RLOO baseline).
    * ``std_unbiased``: divide the variance by ``n - 1`` instead of ``n``.

    Groups: without ``group_ids``, each run of ``group_size`` consecutive rows. With
    ``group_ids`` ``[B]`` (rows sharing an id form a group, in any order and of any size;
    ``group_size`` is then not used), e.g. agent episodes exported as one row per call.
    ``episode_ids`` ``[B]`` (only for per-sequence ``x`` ``[B]``): the statistics count
    every episode once, with the value of its first row (its return from the first call);
    each row is then normalised with its own value, and leave-one-out leaves its whole
    episode out. Without ``episode_ids`` every row is its own episode. A batch whose ids
    are contiguous equal-size groups of one-row episodes takes the same code path as
    ``group_size`` (identical results).

    The std is always taken around the plain (not leave-one-out) mean of the same level.
    ``dim`` (batch level only) restricts the reduction to those dims. Masked-out entries
    are returned as 0.
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in NORM_LEVELS:
            raise ValueError(f"{name}={level!r}; allowed: {list(NORM_LEVELS)}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size}; must be >= 1")
    dtype = torch.float64 if high_precision else torch.float32
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    xd = x.to(dtype)
    m = torch.ones_like(xd) if mask is None else mask.to(dtype)
    xd = xd * m
    for name, ids in (("group_ids", group_ids), ("episode_ids", episode_ids)):
        if ids is not None and ids.reshape(-1).shape[0] != x.shape[0]:
            raise ValueError(f"{name} has {ids.numel()} entries; the batch has {x.shape[0]} rows")
    if group_ids is not None:
        regular = regular_group_size(group_ids, episode_ids)
        if regular is not None:  # the fixed layout: the group_size code path
            group_size, group_ids, episode_ids = regular, None, None
    if episode_ids is not None and torch.unique(episode_ids).numel() == x.shape[0]:
        episode_ids = None  # one row per episode: rows are the units
    first = ep_of_row = None  # episode -> its first row, row -> its episode
    if episode_ids is not None:
        if x.dim() != 1:
            raise ValueError(
                f"episode_ids needs per-sequence values [B]; got shape {tuple(x.shape)}"
            )
        first, ep_of_row = episode_first_rows(episode_ids)
    # an entry's own contribution to the statistics (its episode's, with episode_ids)
    own_x = xd if first is None else xd[first][ep_of_row]
    own_m = m if first is None else m[first][ep_of_row]
    units = _NormUnits(xd, m, first, ep_of_row, group_ids, group_size, dim, reduce_group)
    cache: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(level: str):
        if level not in cache:
            cache[level] = units.stats(level, all_reduce)
        return cache[level]

    y = xd
    if mean_level is not None:
        s, _, c = get(mean_level)
        if mean_leave1out:
            mean = (s - own_x) / (c - own_m).clamp(min=1)
        else:
            mean = s / c.clamp(min=1)
        y = xd - mean
    if std_level is not None:
        s, sq, c = get(std_level)
        mean = s / c.clamp(min=1)
        var = (sq / c.clamp(min=1) - mean.square()).clamp(min=0)
        if std_unbiased:
            var = var * c / (c - 1).clamp(min=1)
        y = y / (var.sqrt() + eps)
    return (y * m).to(out_dtype)
