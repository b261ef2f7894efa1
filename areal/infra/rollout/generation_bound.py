"""The bound on what one training step generates when groups are filtered
(``rollout.max_num_gen_batches``, verl's ``algorithm.filter_groups.max_num_gen_batches``).

With a filter that drops groups (DAPO dynamic sampling, ``actor.dynamic_sampling``, drops
a group whose rewards are all equal), a step's batch fills only as groups pass it. On a
task too hard (or too easy) for the model almost none do, and without a bound the step
generates on and on (a real model on the CPU demo: 9 minutes for the first step, 95% of
the groups filtered, the only sign an informational alarm at its end).

:class:`GroupTally` counts what the training groups finished since the step began gave:
accepted, filtered, ``None``; groups whose rewards are all equal, split into all at or
below zero (too hard, a reward function that cannot read the answers, answers cut at
``max_new_tokens``) and all equal and positive (too easy); samples and truncated samples
(``no_eos``). :class:`GenerationBound` holds the step's tally, a reserve of the newest
filtered groups (at most one batch), and:

- ``reached(batch_size)``: the step's finished groups reached ``max_num_gen_batches x
  batch_size``; the waits of the executor then hand out the accepted groups plus filtered
  ones from the reserve (``take_filler``, within the staleness bound) to fill the batch
  (``rollout_results``; the synchronous trainer through ``fill_at_gen_bound``) and log a
  WARNING naming the figures and what to change (``bound_message``);
- an early WARNING (``on_finished``'s return value) as soon as the step's first batch's
  worth of groups (at most 32) finished with at most a quarter of them accepted (the step
  is on course for the bound); ``progress()``: the figures so far, for the wait's
  one-minute warning;
- both warnings once, then at most every ``_REPEAT_WARN_S`` seconds (the steps that hit
  the bound in between are counted in the next one and in ``rollout/gen_bound_hit``);
- ``end_step()``: the step's figures for the stats (``rollout/gen_bound_hit``,
  ``rollout/n_filler``, ``rollout/n_generated``, ``rollout/n_all_zero``,
  ``rollout/n_all_max``), then a fresh tally.

Not thread-safe by itself: the executor calls it under its condition's lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from areal.utils.rl_statistics import episode_first_rows

__all__ = ["GenerationBound", "GroupTally"]

#: a warning of either kind is repeated at most this often (seconds)
_REPEAT_WARN_S = 600.0
#: the early warning fires when at most this share of the step's first groups (a batch,
#: at most ``_EARLY_GROUPS``) were accepted
_EARLY_ACCEPTED_SHARE = 0.25
_EARLY_GROUPS = 32

ADVICE = (
    "To change: an easier task (or a stronger model), a higher gconfig.temperature, more "
    "samples per group (gconfig.n_samples), more new tokens (gconfig.max_new_tokens) or a "
    "prompt that asks for a short answer; and check the reward function on a few outputs "
    "(rollout.dump_to_file=true writes every trajectory with its reward)."
)
#: when most all-equal groups are all max: the model already solves the prompts
ADVICE_EASY = (
    "Most such groups are solved by every sample: the model has learned these prompts. "
    "To change: harder prompts (or stop here), or more samples per group "
    "(gconfig.n_samples) to find its rare failures."
)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


@dataclass
class GroupTally:
    """What the training groups finished since the step began gave (module docstring)."""

    groups: int = 0
    accepted: int = 0
    filtered: int = 0
    none: int = 0
    all_zero: int = 0  # rewards all equal and <= 0
    all_max: int = 0  # rewards all equal and > 0
    samples: int = 0  # rows of groups that carry `no_eos`
    truncated: int = 0

    def add(self, traj: Any, reason: str | None) -> None:
        """One finished group: ``reason`` None (accepted), ``"filtered"`` or ``"none"``."""
        self.groups += 1
        if reason is None:
            self.accepted += 1
        elif reason == "filtered":
            self.filtered += 1
        elif reason == "none":
            self.none += 1
        if not isinstance(traj, dict):
            return
        rewards = traj.get("rewards")
        if isinstance(rewards, torch.Tensor):
            r = rewards.detach().reshape(-1)
            episode_ids = traj.get("episode_ids")
            if episode_ids is not None and r.numel():
                r = r[episode_first_rows(episode_ids)[0]]
            if r.numel() > 1:  # a single sample has nothing to compare with
                hi, lo = torch.stack([r.amax(), r.amin()]).float().tolist()  # one host sync
                if hi == lo:
                    if hi > 0:
                        self.all_max += 1
                    else:
                        self.all_zero += 1
        no_eos = traj.get("no_eos")
        if isinstance(no_eos, torch.Tensor) and no_eos.numel():
            self.samples += no_eos.numel()
            self.truncated += int(no_eos.bool().sum())

    @property
    def gave_nothing(self) -> int:
        return self.filtered + self.none

    def advice(self) -> str:
        """What to change: for a task too easy when most all-equal groups are all max."""
        return ADVICE_EASY if self.all_max > self.all_zero else ADVICE

    def describe(self) -> str:
        """The figures: all-equal groups (all zero / all max), truncation share."""
        flat = self.all_zero + self.all_max
        text = (
            f"{flat} of {self.groups} groups ({_pct(flat, self.groups)}) had all rewards "
            f"equal: {self.all_zero} all zero or below ({_pct(self.all_zero, self.groups)}: "
            "the task is too hard for the model, the reward function cannot read its "
            f"answers, or the answers were cut at max_new_tokens) and {self.all_max} all max "
            f"(equal and positive, {_pct(self.all_max, self.groups)}: too easy)"
        )
        if self.none:
            text += f"; {self.none} groups returned None by the workflow"
        if self.samples:
            text += (
                f"; {self.truncated} of their {self.samples} samples "
                f"({_pct(self.truncated, self.samples)}) hit gconfig.max_new_tokens (no EOS)"
            )
        else:
            text += "; truncation unknown (the trajectories carry no `no_eos`)"
        return text


class _RateLimit:
    """True the first time, then at most every ``_REPEAT_WARN_S`` seconds."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.suppressed = 0

    def ready(self) -> bool:
        now = time.monotonic()
        if self.last is None or now - self.last >= _REPEAT_WARN_S:
            self.last = now
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n


class GenerationBound:
    """One executor's step tally, reserve of filtered groups and warnings (module docstring).

    Args:
        max_num_gen_batches: ``rollout.max_num_gen_batches`` (None: no bound).
    """

    def __init__(self, max_num_gen_batches: int | None):
        if max_num_gen_batches is not None and max_num_gen_batches < 1:
            raise ValueError(f"max_num_gen_batches={max_num_gen_batches}; must be >= 1 or None")
        self.max_num_gen_batches = max_num_gen_batches
        self.tally = GroupTally()
        #: the newest filtered groups (``RolloutResult``), oldest first
        self.reserve: deque[Any] = deque()
        #: filtered groups handed out to fill a batch, over the executor's life
        self.filler_total = 0
        self._hit = False  # this step reached the bound
        self._filler = 0  # filtered groups handed out this step
        self._early_done = False  # the early check ran this step
        self._bound_warned = False  # the bound's warning was considered this step
        self._early_limit = _RateLimit()
        self._bound_limit = _RateLimit()

    # ------------------------------------------------------------------ recording
    def limit(self, batch_size: int) -> int | None:
        """Groups a step may generate: ``max_num_gen_batches x batch_size`` (None: no bound)."""
        if self.max_num_gen_batches is None:
            return None
        return self.max_num_gen_batches * max(1, int(batch_size))

    def on_finished(
        self, traj: Any, reason: str | None, result: Any, batch_size: int
    ) -> str | None:
        """A training group finished (accepted, ``"filtered"`` with its ``RolloutResult`` in
        ``result``, or ``"none"``); returns the early warning's text when it is due."""
        self.tally.add(traj, reason)
        if reason == "filtered" and result is not None:
            self.reserve.append(result)
            while len(self.reserve) > max(1, int(batch_size)):
                self.reserve.popleft()
        t = self.tally
        if self._early_done or t.groups < min(max(1, int(batch_size)), _EARLY_GROUPS):
            return None
        self._early_done = True
        if t.accepted > _EARLY_ACCEPTED_SHARE * t.groups or not self._early_limit.ready():
            return None
        limit = self.limit(batch_size)
        then = (
            f"at most {limit} groups (rollout.max_num_gen_batches={self.max_num_gen_batches} "
            f"x {batch_size}), then it trains on filtered groups to fill the batch"
            if limit is not None
            else "with no bound (rollout.max_num_gen_batches=null)"
        )
        return (
            f"rollout: only {t.accepted} of the first {t.groups} groups of this step were "
            f"accepted ({t.filtered} filtered out: dynamic sampling drops a group whose "
            f"rewards are all equal): {t.describe()}. The step "
            f"keeps generating until {batch_size} groups are accepted, {then}. {t.advice()}"
        )

    def progress(self) -> str:
        """The step's groups so far, for a wait that has not returned for a minute
        (empty while none finished)."""
        t = self.tally
        if not t.groups:
            return ""
        text = f"this step's {t.groups} finished groups: {t.accepted} accepted, {t.describe()}"
        if t.gave_nothing > t.accepted:
            text += f". {t.advice()}"
        return text

    # ------------------------------------------------------------------ the bound
    def reached(self, batch_size: int) -> bool:
        limit = self.limit(batch_size)
        return limit is not None and self.tally.groups >= limit

    def take_filler(self, n: int, version: int, max_staleness: int) -> list[Any]:
        """Up to ``n`` filtered groups of the reserve, newest first, none older than
        ``max_staleness`` versions (older ones are dropped)."""
        out: list[Any] = []
        while self.reserve and len(out) < n:
            r = self.reserve.pop()
            if version - r.submit_version <= max_staleness:
                out.append(r)
        while self.reserve and version - self.reserve[0].submit_version > max_staleness:
            self.reserve.popleft()
        self._hit = True
        self._filler += len(out)
        self.filler_total += len(out)
        return out

    def bound_message(self, batch_size: int, accepted: int, filler: int) -> str | None:
        """The WARNING of a step that reached the bound (None when this step warned
        already, or while rate-limited)."""
        if self._bound_warned:
            return None
        self._bound_warned = True
        if not self._bound_limit.ready():
            return None
        t = self.tally
        got = accepted + filler
        what = (
            f"training on the {accepted} accepted groups plus {filler} filtered ones to fill "
            f"the batch of {batch_size} (with group-normalised advantages, as GRPO's, a "
            "filtered group adds no policy gradient: as if there were no filter)"
        )
        if got < batch_size:
            what += (
                f"; only {filler} filtered groups were kept, so the batch has {got} groups"
                if got
                else "; no filtered group was kept to fill it (the workflow returned None), "
                "so the step waits for an accepted one and the run stops after "
                "rollout.max_consecutive_rejections rejections in a row"
            )
        again = self._bound_limit.take_suppressed()
        return (
            f"rollout: this step generated {t.groups} groups (the bound "
            f"rollout.max_num_gen_batches={self.max_num_gen_batches} x {batch_size}) and "
            f"only {accepted} passed the filter; {what}. {t.describe()}. {t.advice()} "
            "rollout/gen_bound_hit counts the steps that reached the bound"
            + (f" ({again} more since the last warning)." if again else ".")
        )

    # ------------------------------------------------------------------ step
    def end_step(self) -> dict[str, float]:
        """The step's figures for the stats (``rollout/...``), then a fresh tally."""
        t = self.tally
        stats = {
            "gen_bound_hit": float(self._hit),
            "n_filler": float(self._filler),
            "n_generated": float(t.groups),
            "n_all_zero": float(t.all_zero),
            "n_all_max": float(t.all_max),
        }
        self.tally = GroupTally()
        self._hit, self._filler, self._early_done, self._bound_warned = False, 0, False, False
        return stats

    def clear(self) -> None:
        """Forget the step and the reserve (a rollback discards every rollout)."""
        self.reserve.clear()
        self.end_step()
