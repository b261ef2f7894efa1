"""Pure tensor RL ops: policy/critic losses, KL estimators, GAE, normalisation, filters.

Everything here is batched tensor code (no per-element host syncs). Per-token tensors are
aligned with the token they score: position ``i`` holds the value for ``input_ids[..., i]``
(see the shared tensor conventions); functions accept either padded ``[B, T]`` tensors or
packed 1-D ``[n_tokens]`` tensors with ``cu_seqlens`` where sequence structure matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "KL_ESTIMATORS",
    "kl_estimator",
    "masked_normalization",
    "group_normalization",
    "gae",
    "compute_returns",
    "reward_overlong_penalty",
    "sequence_index",
    "sequence_mean",
    "ppo_actor_loss_fn",
    "sapo_loss_fn",
    "m2po_loss_mask",
    "ppo_critic_loss_fn",
    "aggregate_token_loss",
    "LOSS_AGG_MODES",
    "REJECTION_LEVELS",
    "REJECTION_ACTIONS",
    "REJECTION_METRICS",
    "REJECTION_AGGS",
    "RejectionSamplingResult",
    "apply_rejection_sampling",
    "loglinear_prox_logp",
    "dynamic_sampling_accept",
    "uniform_reward_group_mask",
    "episode_first_rows",
    "regular_group_size",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
NORM_LEVELS = ("batch", "group", None)
REJECTION_LEVELS = ("token", "sequence")
REJECTION_ACTIONS = ("mask", "clamp")
REJECTION_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
REJECTION_AGGS = ("sum", "mean", "max")


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

    def unit_stats() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sum, sumsq, count) per statistics unit: episodes (their first row) or rows."""
        if first is not None:
            v, mv = xd[first], m[first]
            return v, v.square(), mv
        flat, mflat = xd.reshape(x.shape[0], -1), m.reshape(x.shape[0], -1)
        return flat.sum(1), flat.square().sum(1), mflat.sum(1)

    def stats(level: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Broadcastable (sum, sumsq, count) for a level."""
        expand = (x.shape[0], *([1] * (x.dim() - 1)))
        if level == "group" and group_ids is None and first is not None:
            raise ValueError("episode_ids without group_ids cannot form groups")
        if level == "group" and group_ids is not None:
            _, g_of_row = torch.unique(group_ids, return_inverse=True)
            n_groups = int(g_of_row.max()) + 1 if g_of_row.numel() else 0
            owner = g_of_row
            if first is not None:
                owner = g_of_row[first]
                if not torch.equal(owner[ep_of_row], g_of_row):
                    raise ValueError("rows of one episode carry different group_ids")
            out = []
            for u in unit_stats():
                acc = torch.zeros(n_groups, dtype=dtype, device=x.device)
                out.append(acc.index_add_(0, owner, u)[g_of_row].reshape(expand))
            return out[0], out[1], out[2]
        if level == "group":
            if x.shape[0] % group_size != 0:
                raise ValueError(
                    f"group_size={group_size} does not divide the batch size {x.shape[0]}"
                )
            shape = (x.shape[0] // group_size, group_size, *x.shape[1:])
            xg, mg = xd.reshape(shape), m.reshape(shape)
            dims = tuple(range(1, xg.dim()))
            s = xg.sum(dims, keepdim=True)
            sq = xg.square().sum(dims, keepdim=True)
            c = mg.sum(dims, keepdim=True)
            rep = lambda t: t.repeat_interleave(group_size, 0).reshape(expand)  # noqa: E731
            return rep(s), rep(sq), rep(c)
        if first is not None:  # every episode once
            v, vsq, mv = unit_stats()
            s, sq, c = (t.sum().reshape(1) for t in (v, vsq, mv))  # x is [B]
            if all_reduce:
                _all_reduce_sum([s, sq, c], reduce_group)
            return s, sq, c
        dims = tuple(range(x.dim())) if dim is None else dim
        s = xd.sum(dims, keepdim=True)
        sq = xd.square().sum(dims, keepdim=True)
        c = m.sum(dims, keepdim=True)
        if all_reduce:
            _all_reduce_sum([s, sq, c], reduce_group)
        return s, sq, c

    cache: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(level: str):
        if level not in cache:
            cache[level] = stats(level)
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


# ---------------------------------------------------------------------- rewards / GAE
@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over padded ``[B, T]`` tensors.

    Token ``t`` with ``loss_mask[b, t] = 1`` is an action; ``values[b, t]`` is the value of
    the state it was taken in and ``rewards[b, t]`` its reward. Positions outside the mask
    are skipped (the next action of ``t`` is the next masked position; the episode ends
    after the last one, with value 0)::

        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lam * A_next(t)

    Returns ``(advantages, returns = advantages + values)``, both 0 outside the mask.
    A reverse scan over time, vectorised over the batch.
    """
    mask = loss_mask.bool()
    r = rewards.float()
    v = values.float()
    bs, seqlen = r.shape
    adv = torch.zeros_like(r)
    next_value = torch.zeros(bs, dtype=r.dtype, device=r.device)
    last_gae = torch.zeros(bs, dtype=r.dtype, device=r.device)
    for t in range(seqlen - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        new_gae = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m, new_gae, 0.0)
        next_value = torch.where(m, v[:, t], next_value)
        last_gae = torch.where(m, new_gae, last_gae)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


@torch.no_grad()
def compute_returns(
    rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Discounted reward-to-go over the masked positions of ``[B, T]`` (GAE with V = 0, lam = 1)."""
    adv, _ = gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), loss_mask, gamma, 1.0)
    return adv


def reward_overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    overlong_tokens: int,
    overlong_penalty_factor: float,
    max_response_length: int,
) -> torch.Tensor:
    """DAPO soft overlong punishment added to sequence rewards ``[B]``.

    With ``L_max = max_response_length`` and cache ``L_c = overlong_tokens``: no penalty for
    ``|y| <= L_max - L_c``; ``((L_max - L_c) - |y|) / L_c * factor`` inside the cache;
    ``-factor`` beyond ``L_max``.
    """
    if overlong_tokens <= 0 or overlong_tokens > max_response_length:
        raise ValueError(
            f"overlong_tokens={overlong_tokens}; must be in [1, max_new_tokens={max_response_length}]"
        )
    expected = max_response_length - overlong_tokens
    lengths = response_lengths.to(torch.float32)
    penalty = ((expected - lengths) / overlong_tokens).clamp(min=-1.0, max=0.0)
    return rewards.float() + overlong_penalty_factor * penalty


# ---------------------------------------------------------------- sequence helpers
def sequence_index(cu_seqlens: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """For packed tokens, the sequence id of every token: ``[0,0,0,1,1,2,...]``."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(seqlens.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(ids, seqlens, output_size=n_tokens)


def _seq_sum(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Per-sequence masked sums ``[n_seqs]`` (packed 1-D with cu_seqlens, or padded 2-D)."""
    xm = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if x.dim() == 2:
        return xm.sum(-1)
    if cu_seqlens is None:
        raise ValueError("cu_seqlens is required for packed 1-D tensors")
    idx = sequence_index(cu_seqlens, x.numel())
    out = torch.zeros(cu_seqlens.numel() - 1, dtype=x.dtype, device=x.device)
    return out.index_add(0, idx, xm)


def _broadcast_seq(
    v: torch.Tensor, like: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    if like.dim() == 2:
        return v.unsqueeze(-1).expand_as(like)
    return v[sequence_index(cu_seqlens, like.numel())]


def sequence_mean(
    x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked mean of each sequence ``[n_seqs]`` (0 for sequences with no masked token)."""
    mask = mask.bool()
    n = _seq_sum(mask.to(x.dtype), mask, cu_seqlens)
    return _seq_sum(x, mask, cu_seqlens) / n.clamp(min=1)


def aggregate_token_loss(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to the micro-batch loss.

    * ``token-mean``: mean over all masked tokens (weight the micro-batch by its token count).
    * ``seq-mean-token-mean``: token mean per sequence, then mean over sequences that have
      loss tokens (weight by that number of sequences).
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): token *sum* per sequence divided by the
      constant ``norm_constant`` (e.g. ``max_new_tokens``), mean over sequences.
    """
    mask = loss_mask.bool()
    if mode == "token-mean":
        total = torch.where(mask, token_loss, 0.0).sum()
        return total / mask.sum().clamp(min=1)
    n_tok = _seq_sum(mask.to(token_loss.dtype), mask, cu_seqlens)
    has_tokens = n_tok > 0
    n_seqs = has_tokens.sum().clamp(min=1)
    seq_sum = _seq_sum(token_loss, mask, cu_seqlens)
    if mode == "seq-mean-token-mean":
        return (seq_sum / n_tok.clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError(
                f"loss_agg_mode={mode!r} needs a positive norm constant, got {norm_constant}"
            )
        return seq_sum.sum() / (norm_constant * n_seqs)
    raise ValueError(f"loss_agg_mode={mode!r}; allowed: {list(LOSS_AGG_MODES)}")


# ------------------------------------------------ staleness: rejection sampling, prox
@dataclass
class RejectionSamplingResult:
    """Outcome of :func:`apply_rejection_sampling` (all per-token, shaped like the inputs).

    ``keep_mask``: loss tokens that stay in the loss (``loss_mask`` minus the rejected ones);
    ``behave_imp_weight``: the behaviour importance weight ``pi_prox / pi_behave`` after
    clamping, 0 outside ``keep_mask``; ``affected``: loss tokens that were rejected
    (``mask``) or whose weight was clamped (``clamp``); ``filtered_fraction``: scalar
    tensor, ``affected`` tokens / loss tokens.
    """

    keep_mask: torch.Tensor
    behave_imp_weight: torch.Tensor
    affected: torch.Tensor
    filtered_fraction: torch.Tensor


def _rs_field(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _seq_reduce(
    x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None, how: str
) -> torch.Tensor:
    """Per-sequence ``sum`` / ``mean`` / ``max`` of ``x`` over ``mask`` (0 for empty sequences)."""
    if how == "sum":
        return _seq_sum(x, mask, cu_seqlens)
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


def apply_rejection_sampling(
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
) -> RejectionSamplingResult:
    """Staleness filter of the decoupled loss (AReaL's ``rejection_sampling``).

    ``config`` has ``level``, ``action``, ``metric``, ``agg``, ``upper``, ``lower`` (a
    ``RejectionSamplingConfig``, any object or dict with those names). With
    ``log r = proximal - old`` per token (``r = pi_prox / pi_behave``; non-finite values
    count as 0) the metric is ``r`` (``ratio``), ``log r`` (``kl_k1``), ``(log r)^2 / 2``
    (``kl_k2``) or ``1/r - 1 + log r`` (``kl_k3``: :func:`kl_estimator` ``k3`` of
    (proximal, old), as AReaL). A value is in bounds when ``<= upper`` and, if ``lower``
    is set, ``>= lower``.

    * ``level="token"``: each loss token is judged on its own metric; its weight is ``r``.
    * ``level="sequence"``: the metric is aggregated over the loss tokens of each sequence
      (``agg``: ``sum`` / ``mean`` / ``max``; for ``ratio`` the aggregation is of ``log r``
      and exponentiated back: the product / geometric mean / largest ratio) and the whole
      sequence shares the decision. With ``ratio`` every token's weight is the
      sequence's geometric-mean ratio (GSPO-style); with KL metrics weights stay per token.
    * ``action="mask"``: out-of-bounds tokens (sequences) leave the loss (``keep_mask``);
      ``action="clamp"`` (``ratio`` only): their weight is clamped into
      ``[lower or 0, upper]`` and they stay.

    Packed 1-D inputs need ``cu_seqlens`` at sequence level.
    """
    level = _rs_field(config, "level", "token")
    action = _rs_field(config, "action", "mask")
    metric_name = _rs_field(config, "metric", "ratio")
    agg = _rs_field(config, "agg", "mean")
    upper = float(_rs_field(config, "upper", 5.0))
    lower = _rs_field(config, "lower", None)
    for name, value, allowed in (
        ("level", level, REJECTION_LEVELS),
        ("action", action, REJECTION_ACTIONS),
        ("metric", metric_name, REJECTION_METRICS),
        ("agg", agg, REJECTION_AGGS),
    ):
        if value not in allowed:
            raise ValueError(f"rejection_sampling.{name}={value!r}; allowed: {list(allowed)}")
    if action == "clamp" and metric_name != "ratio":
        raise ValueError(
            f"rejection_sampling.action='clamp' needs metric='ratio', got {metric_name!r}"
        )
    if proximal_logprobs.shape != old_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"shapes differ: proximal {tuple(proximal_logprobs.shape)}, old "
            f"{tuple(old_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if level == "sequence" and proximal_logprobs.dim() == 1 and cu_seqlens is None:
        raise ValueError("rejection_sampling.level='sequence' on packed inputs needs cu_seqlens")
    mask = loss_mask.bool()
    log_r = proximal_logprobs.detach().float() - old_logprobs.detach().float()
    log_r = torch.where(mask & torch.isfinite(log_r), log_r, 0.0)
    if metric_name == "ratio":
        metric = log_r  # compared in log space: log r vs log(bound)
    else:
        metric = kl_estimator(log_r, torch.zeros_like(log_r), metric_name[3:])
    weight = torch.exp(log_r)

    if level == "sequence":
        seq_metric = _seq_reduce(metric, mask, cu_seqlens, agg)
        metric = _broadcast_seq(seq_metric, log_r, cu_seqlens)
        if metric_name == "ratio":
            seq_log_w = sequence_mean(log_r, mask, cu_seqlens)
            weight = torch.exp(_broadcast_seq(seq_log_w, log_r, cu_seqlens))
    if metric_name == "ratio":
        metric = torch.exp(metric)
    in_bounds = metric <= upper
    if lower is not None:
        in_bounds = in_bounds & (metric >= float(lower))

    if action == "mask":
        keep = mask & in_bounds
        affected = mask & ~in_bounds
    else:
        lo = 0.0 if lower is None else float(lower)
        clamped = torch.where(in_bounds, weight, weight.clamp(min=lo, max=upper))
        affected = mask & (clamped != weight)
        weight = clamped
        keep = mask
    weight = torch.where(keep, weight, 0.0)
    frac = affected.sum().float() / mask.sum().clamp(min=1).float()
    return RejectionSamplingResult(
        keep_mask=keep, behave_imp_weight=weight, affected=affected, filtered_fraction=frac
    )


@torch.no_grad()
def loglinear_prox_logp(
    old_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    versions: torch.Tensor,
    proximal_version: int,
    update_progress: float = 0.0,
) -> torch.Tensor:
    """Log-linear approximation of the proximal logprobs (``prox_logp_method="loglinear"``).

    Assumes a token's log-probability moves linearly with the policy version between the
    behaviour policy (version ``v_b = versions``, logprob ``old_logprobs``) and the
    policy being trained (``logprobs``, version ``v_theta``)::

        alpha = (v_prox - v_b) / (v_theta - v_b)      clamped to [0, 1]
        prox  = old + alpha * (logprobs - old)

    ``proximal_version`` (``v_prox``) is the version of the weights the update started
    from, i.e. the weights a recompute would use; ``v_theta = v_prox + update_progress``
    where ``update_progress`` is the fraction of this update's optimizer steps already
    taken (minibatch index / number of minibatches). So tokens generated by the proximal
    weights (``v_b = v_prox``) get ``old`` exactly, and in the first minibatch
    (``update_progress = 0``, the weights are still the proximal ones) every older token
    gets ``logprobs`` exactly. Tokens with ``versions < 0`` (prompt) get ``old``.
    """
    v_b = versions.to(torch.float64)
    v_prox = float(proximal_version)
    v_theta = v_prox + float(update_progress)
    gap = v_theta - v_b
    generated = versions >= 0
    alpha = torch.where(generated & (gap > 0), (v_prox - v_b) / gap.clamp(min=1e-12), 0.0)
    alpha = alpha.clamp(0.0, 1.0).to(torch.float32)
    old = old_logprobs.detach().float()
    return old + alpha * (logprobs.detach().float() - old)


# --------------------------------------------------------------------- policy losses
def _sequence_ratio(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: per-sequence ratio ``exp(mean_t log r_t)`` and mean advantage, broadcast to tokens."""
    seq_log_ratio = sequence_mean(log_ratio, mask, cu_seqlens)
    seq_adv = sequence_mean(advantages, mask, cu_seqlens)
    ratio = torch.exp(_broadcast_seq(seq_log_ratio, log_ratio, cu_seqlens))
    adv = _broadcast_seq(seq_adv, advantages, cu_seqlens)
    return ratio, adv


def _check_is_level(level: str) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r}; allowed: ['token', 'sequence']")


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling: Any = None,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_constant: float | None = None,
    token_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled clipped PPO surrogate (AReaL), with clip-higher, dual clip and GSPO.

    ``ratio = exp(logprobs - proximal_logprobs)`` (token) or the sequence geometric mean
    (``importance_sampling_level="sequence"``, GSPO; advantages are then averaged per
    sequence). Per token::

        L = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_higher))
        L = min(L, c_clip * |A|)            if c_clip (dual clip; binds only for A < 0)
        L = L * w                           w = behaviour importance weight

    ``rejection_sampling`` (a ``RejectionSamplingConfig``, see
    :func:`apply_rejection_sampling`) sets ``w = pi_prox / pi_behave`` (clamped by
    ``action="clamp"``) and removes rejected tokens (``action="mask"``); ``None`` applies
    no behaviour weight (``w = 1``) and filters nothing, as AReaL. Rejected tokens (and
    tokens where ``token_keep_mask`` is False, e.g. the M2PO mask) leave the loss — also
    the GSPO sequence ratio — but stay in its denominator, so the micro-batch weight is
    unchanged. The result is aggregated by ``loss_agg_mode`` (:func:`aggregate_token_loss`).

    Returns ``(loss, stats)``; stats hold per-token tensors: ``loss``,
    ``importance_weight``, ``approx_kl`` (``logprobs - proximal``), ``clip_mask``,
    ``dual_clip_mask`` and, with ``rejection_sampling``, ``behave_imp_weight``,
    ``behave_approx_kl``, ``behave_mask`` (tokens kept with a positive weight),
    ``rs_affected`` (rejected or clamped) and the scalar ``filtered_fraction``.
    """
    _check_is_level(importance_sampling_level)
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip={c_clip}; must be > 1.0 (or None to disable dual clip)")
    mask = loss_mask.bool()
    advantages = advantages.detach().float()
    prox = proximal_logprobs.detach().float()
    old = old_logprobs.detach().float()
    rs = None
    active = mask
    if rejection_sampling is not None:
        rs = apply_rejection_sampling(prox, old, mask, rejection_sampling, cu_seqlens)
        active = rs.keep_mask
    if token_keep_mask is not None:
        active = active & token_keep_mask.bool()
    log_ratio = logprobs.float() - prox
    log_ratio = torch.where(active, log_ratio, 0.0)
    if importance_sampling_level == "sequence":
        ratio, advantages = _sequence_ratio(log_ratio, advantages, active, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    ratio = torch.where(active, ratio, 0.0)
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    loss1 = -advantages * ratio
    loss2 = -advantages * clipped_ratio
    clip_mask = (loss1.detach() < loss2.detach()) & active
    pg_loss = torch.maximum(loss1, loss2)
    if c_clip is not None:
        loss3 = c_clip * advantages.abs()
        dual_clip_mask = (loss3 < pg_loss.detach()) & active
        pg_loss = torch.minimum(pg_loss, loss3)
    else:
        dual_clip_mask = torch.zeros_like(mask)
    if rs is not None:
        pg_loss = pg_loss * rs.behave_imp_weight
    pg_loss = torch.where(active, pg_loss, 0.0)

    loss = aggregate_token_loss(pg_loss, mask, loss_agg_mode, cu_seqlens, loss_norm_constant)
    stats = dict(
        loss=pg_loss.detach(),
        importance_weight=ratio.detach(),
        approx_kl=log_ratio.detach(),
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
    )
    if rs is not None:
        behave_mask = active & (rs.behave_imp_weight > 0)
        stats.update(
            behave_imp_weight=torch.where(active, rs.behave_imp_weight, 0.0),
            behave_approx_kl=torch.where(behave_mask, prox - old, 0.0),
            behave_mask=behave_mask,
            rs_affected=rs.affected,
            filtered_fraction=rs.filtered_fraction,
        )
    return loss, stats


def sapo_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: torch.Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_constant: float | None = None,
    token_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate replaces the hard clip (arXiv 2511.20347).

    ``L_t = -(4 / tau) * sigmoid(tau * (r_t - 1)) * A_t`` with ``tau = tau_pos`` for
    ``A_t > 0`` and ``tau_neg`` otherwise. The gradient w.r.t. ``log r`` is
    ``-4 s (1 - s) r A`` (``s`` the sigmoid): exactly ``-A`` at ``r = 1`` (like the
    unclipped surrogate) and decaying smoothly as ``r`` leaves 1. Not defined for the
    decoupled objective (the actor raises a config error).
    """
    _check_is_level(importance_sampling_level)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo_tau_pos={tau_pos}, sapo_tau_neg={tau_neg}; both must be > 0")
    mask = loss_mask.bool()
    advantages = advantages.detach().float()
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.detach().float(), 0.0)
    if importance_sampling_level == "sequence":
        ratio, advantages = _sequence_ratio(log_ratio, advantages, mask, cu_seqlens)
    else:
        ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    keep = mask if token_keep_mask is None else mask & token_keep_mask.bool()
    token_loss = torch.where(keep, -gate * advantages, 0.0)
    loss = aggregate_token_loss(token_loss, mask, loss_agg_mode, cu_seqlens, loss_norm_constant)
    stats = dict(
        loss=token_loss.detach(),
        importance_weight=torch.where(mask, ratio, 0.0).detach(),
        approx_kl=log_ratio.detach(),
        clip_mask=torch.zeros_like(mask),
        dual_clip_mask=torch.zeros_like(mask),
        sapo_soft_gate=gate.detach(),
    )
    return loss, stats


@torch.no_grad()
def m2po_loss_mask(
    old_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    m2_threshold: float,
) -> torch.Tensor:
    """M2PO second-moment trust mask (arXiv 2510.01161).

    With ``d_t = proximal - old`` (log importance weight of the stale behaviour policy),
    drop the tokens with the largest ``d_t^2`` until the mean of ``d^2`` over the kept
    tokens is ``<= m2_threshold``. Returns the new bool mask (the fewest tokens dropped).
    """
    if m2_threshold <= 0:
        raise ValueError(f"m2_threshold={m2_threshold}; must be > 0")
    mask = loss_mask.bool()
    d2 = (proximal_logprobs.float() - old_logprobs.float()).square()
    flat_mask = mask.reshape(-1)
    vals = d2.reshape(-1)[flat_mask]
    n = vals.numel()
    if n == 0:
        return mask
    sorted_vals, order = torch.sort(vals, descending=True)
    # suffix means: mean of sorted_vals[k:] for k = 0..n-1 (non-increasing in k)
    suffix_sum = torch.flip(torch.cumsum(torch.flip(sorted_vals.double(), [0]), 0), [0])
    counts = torch.arange(n, 0, -1, device=vals.device, dtype=torch.float64)
    ok = suffix_sum / counts <= m2_threshold
    # first k that satisfies the bound (all n dropped if none does, k = n)
    k = torch.where(ok.any(), ok.int().argmax(), torch.tensor(n, device=vals.device))
    keep_sorted = torch.arange(n, device=vals.device) >= k
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    new_flat = flat_mask.clone()
    new_flat[flat_mask] = keep
    return new_flat.view_as(mask)


# --------------------------------------------------------------------- critic loss
def ppo_critic_loss_fn(
    value: torch.Tensor,
    old_value: torch.Tensor,
    target_value: torch.Tensor,
    value_eps_clip: float,
    loss_mask: torch.Tensor,
    loss_fn_type: str = "mse",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``max(l(V), l(V_old + clip(V - V_old, -eps, eps)))``, token mean.

    ``l`` is ``0.5 * (V - R)^2`` (``mse``) or the Huber loss with delta 10 (``huber``).
    """
    if loss_fn_type == "mse":

        def lf(x: torch.Tensor) -> torch.Tensor:
            return 0.5 * (x - target_value).square()
    elif loss_fn_type == "huber":

        def lf(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.huber_loss(x, target_value, reduction="none", delta=10.0)
    else:
        raise ValueError(f"loss_fn_type={loss_fn_type!r}; allowed: ['mse', 'huber']")
    mask = loss_mask.bool()
    value = value.float()
    target_value = target_value.detach().float()
    old_value = old_value.detach().float()
    loss_orig = lf(value)
    clipped = old_value + (value - old_value).clamp(-value_eps_clip, value_eps_clip)
    loss_clip = lf(clipped)
    token_loss = torch.maximum(loss_orig, loss_clip)
    clip_mask = (loss_clip.detach() > loss_orig.detach()) & mask
    loss = torch.where(mask, token_loss, 0.0).sum() / mask.sum().clamp(min=1)
    return loss, dict(loss=token_loss.detach(), clip_mask=clip_mask)


# ----------------------------------------------------------------- dynamic sampling
def uniform_reward_group_mask(
    rewards: torch.Tensor,
    group_size: int = 1,
    group_ids: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[B]``: True for rows whose group has non-identical rewards, i.e. rows that
    DAPO dynamic sampling keeps.

    Groups are runs of ``group_size`` consecutive rows, or the rows sharing a
    ``group_ids`` value. With ``episode_ids`` the rewards compared are the episodes'
    (the reward of each episode's first row, its return from the first call), so the
    discounted rewards of an episode's earlier calls do not make a group look mixed.
    """
    rewards = rewards.reshape(-1)
    if group_ids is None:
        if episode_ids is not None:
            raise ValueError("episode_ids needs group_ids")
        if rewards.numel() % group_size != 0:
            raise ValueError(
                f"group_size={group_size} does not divide the batch size {rewards.numel()}"
            )
        g = rewards.reshape(-1, group_size)
        keep = (g.amax(-1) != g.amin(-1)).repeat_interleave(group_size)
        return keep
    _, g_of_row = torch.unique(torch.as_tensor(group_ids).reshape(-1), return_inverse=True)
    n_groups = int(g_of_row.max()) + 1 if g_of_row.numel() else 0
    values, owner = rewards, g_of_row
    if episode_ids is not None:
        first, _ = episode_first_rows(episode_ids)
        values, owner = rewards[first], g_of_row[first]
    hi = torch.full((n_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    lo = torch.full((n_groups,), float("inf"), dtype=values.dtype, device=values.device)
    hi = hi.scatter_reduce(0, owner, values, reduce="amax")
    lo = lo.scatter_reduce(0, owner, values, reduce="amin")
    return (hi != lo)[g_of_row]


def dynamic_sampling_accept(trajectory: dict[str, Any]) -> bool:
    """``should_accept_fn`` for DAPO dynamic sampling: reject a group whose rewards are all equal.

    ``trajectory`` is one prompt's group (padded dict with ``rewards`` ``[G]``). With
    ``episode_ids`` (an agent's calls exported as one row each) the episodes' rewards
    are compared: the reward of each episode's first row (its return from the first
    call). A single sample (episode) is kept (nothing to compare). One host sync per group.
    """
    rewards = trajectory["rewards"]
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    rewards = rewards.reshape(-1)
    episode_ids = trajectory.get("episode_ids")
    if episode_ids is not None:
        first, _ = episode_first_rows(episode_ids)
        rewards = rewards[first]
    if rewards.numel() <= 1:  # no group to compare against: keep it
        return True
    return bool((rewards.amax() != rewards.amin()).item())
