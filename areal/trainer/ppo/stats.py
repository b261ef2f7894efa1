"""Statistics of a PPO step that the trainer logs: the consumed batch, server-vs-trainer
logprob consistency, and the update's per-minibatch stats averaged.

``consistency_partials`` runs where the batch is held (a worker's ``BatchStore``, through
``BatchRef.apply``) and returns three numbers per shard; ``combine_consistency`` turns the
shards' partials into the same figures ``consistency_stats`` computes from a whole batch.
"""

from __future__ import annotations

from typing import Any

import torch


def batch_stats(batch: dict[str, torch.Tensor], version: int) -> dict[str, float]:
    """Reward, lengths and the staleness histogram of the consumed batch."""
    stats: dict[str, float] = {}
    rewards = batch["rewards"].float()
    stats["batch/reward"] = float(rewards.mean())
    stats["batch/accuracy"] = float((rewards > 0).float().mean())
    loss_mask = batch["loss_mask"].bool()
    gen_len = loss_mask.sum(-1).float()
    stats["batch/gen_len"] = float(gen_len.mean())
    seq_len = batch["attention_mask"].sum(-1).float()
    stats["batch/seq_len"] = float(seq_len.mean())
    stats["batch/seq_len_min"] = float(seq_len.min())
    stats["batch/seq_len_max"] = float(seq_len.max())
    stats["batch/n_seqs"] = float(rewards.numel())
    versions = batch["versions"][loss_mask]
    if versions.numel() > 0:
        lag = (version - versions).clamp(min=0)
        stats["staleness/max"] = float(lag.max())
        stats["staleness/avg"] = float(lag.float().mean())
        counts = torch.bincount(lag, minlength=1)
        for k, c in enumerate(counts.tolist()):
            stats[f"staleness/hist/{k}"] = c / versions.numel()
    return stats


def consistency_partials(batch: dict[str, torch.Tensor], version: int) -> tuple[int, float, float]:
    """``(n, sum, max)`` of ``|prox_logp - logprobs|`` over this batch's loss tokens of
    version ``version`` (the tokens the servers sampled with the trainer's current weights)."""
    fresh = batch["loss_mask"].bool() & (batch["versions"] == version)
    n = int(fresh.sum())
    if n == 0:
        return 0, 0.0, 0.0
    diff = (batch["prox_logp"].float() - batch["logprobs"].float()).abs()[fresh]
    return n, float(diff.sum()), float(diff.max())


def combine_consistency(partials: list[tuple[int, float, float]]) -> dict[str, float]:
    """The shards' ``consistency_partials`` -> the ``consistency/*`` stats."""
    n = sum(p[0] for p in partials)
    if n == 0:
        return {"consistency/fresh_tokens": 0.0}
    return {
        "consistency/fresh_tokens": float(n),
        "consistency/logp_absdiff_max": max(p[2] for p in partials if p[0]),
        "consistency/logp_absdiff_avg": sum(p[1] for p in partials) / n,
    }


def consistency_stats(batch: dict[str, torch.Tensor], version: int) -> dict[str, float]:
    """Server vs trainer log-probabilities on tokens generated with the current weights.

    Tokens of version ``version`` were sampled by the servers with exactly the weights the
    trainer holds now, so their behaviour logprobs must equal the recomputed ones; a gap
    means the weight sync or the numerics of the two sides disagree.
    """
    return combine_consistency([consistency_partials(batch, version)])


def flatten_stats(stats: Any) -> dict[str, float]:
    """ppo_update returns a dict or a list of per-minibatch dicts: average the list."""
    if stats is None:
        return {}
    if isinstance(stats, dict):
        return {k: float(v) for k, v in stats.items() if is_number(v)}
    acc: dict[str, list[float]] = {}
    for d in stats:
        for k, v in d.items():
            if is_number(v):
                acc.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, int | float)
