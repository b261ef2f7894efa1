"""The detectors of run health (``areal.utils.run_health`` runs them every step).

Each detector reads the recent values of one or two *signals* (per-step scalars taken
from the trainer's statistics, ``SIGNAL_KEYS``) from a :class:`SignalHistory` and returns
a :class:`Finding` (its condition holds or not, the value it judged, the threshold, the
recent values) or ``None`` when there is not enough data to judge (too few steps, a
metric the run does not log, no evaluation yet). Missing and non-finite values are not
recorded, so a metric measured only on some steps (the logprob consistency needs tokens
sampled with the trainer's current weights) is judged on the steps that measured it.

The thresholds are ``RunHealthConfig``'s (``areal.api.health_config``); docs/run_health.md
says what each detector compares and why its default is conservative.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal.api.health_config import RunHealthConfig

#: signal -> the stats keys it is read from (first present, finite one wins)
SIGNAL_KEYS: dict[str, tuple[str, ...]] = {
    "entropy": ("ppo_actor/update/entropy/avg",),
    "reward": ("batch/reward", "ppo_actor/task_reward/avg", "rollout/reward"),
    "length": ("batch/gen_len", "rollout/completion_len"),
    "truncation": ("health/signal/truncation", "rollout/no_eos"),
    "importance_weight": ("ppo_actor/update/importance_weight/avg",),
    "kl": ("ppo_actor/update/approx_kl/avg",),
    "clip_fraction": ("ppo_actor/update/clip_ratio/avg",),
    "logprob_mismatch": ("consistency/logp_absdiff_avg",),
    "no_signal_share": ("health/signal/no_signal_share",),
    "reward_length_corr": ("health/signal/reward_length_corr",),
    "heldout": ("eval/accuracy", "eval-rollout/reward"),
    "heldout_n": ("eval-rollout/reward__count", "eval/n"),
}
SHORT = 2  # steps of the "now" of fast detectors (blow-ups, reward drop)


@dataclass
class Finding:
    """What a detector saw at one step."""

    firing: bool
    value: float
    threshold: float
    detail: str
    recent: list[tuple[int, float]] = field(default_factory=list)


class SignalHistory:
    """The finite values of every signal, by step (steps ascending)."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = {}

    def add(self, step: int, name: str, value: Any) -> None:
        try:
            v = float(value)
        except (TypeError, ValueError):
            return
        if math.isfinite(v):
            self.series.setdefault(name, []).append((int(step), v))

    def get(self, name: str) -> list[tuple[int, float]]:
        return self.series.get(name, [])

    def last(self, name: str, n: int) -> list[tuple[int, float]]:
        return self.get(name)[-n:] if n > 0 else []

    def truncate_after(self, step: int) -> None:
        """Forget the values of steps later than ``step`` (after a rollback)."""
        for name, pts in self.series.items():
            self.series[name] = [p for p in pts if p[0] <= step]


def signals_from_stats(stats: dict[str, Any], verifier_key: str | None = None) -> dict[str, float]:
    """The signals of one step's stats (``SIGNAL_KEYS``; ``verifier`` from ``verifier_key``)."""
    out: dict[str, float] = {}
    keys = dict(SIGNAL_KEYS)
    if verifier_key:
        keys["verifier"] = (verifier_key,)
    for name, candidates in keys.items():
        for k in candidates:
            v = stats.get(k)
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(f):
                out[name] = f
                break
    return out


def _mean(pts: list[tuple[int, float]]) -> float:
    return sum(v for _, v in pts) / len(pts)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# ----------------------------------------------------------------------------- detectors
def entropy_collapse(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    pts = h.get("entropy")
    if len(pts) < c.baseline_steps + 1:
        return None
    base = statistics.median(v for _, v in pts[: c.baseline_steps])
    recent = pts[c.baseline_steps :][-SHORT:]  # each value already averages every token
    now = _mean(recent)
    thr = c.entropy_collapse_ratio * base
    return Finding(
        now < thr,
        now,
        thr,
        f"mean token entropy {_fmt(now)} over the last {len(recent)} steps; baseline "
        f"{_fmt(base)} (median of the first {c.baseline_steps}), alarm below "
        f"{c.entropy_collapse_ratio} x baseline",
        recent,
    )


def reward_drop(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    pts = h.get("reward")
    if len(pts) < SHORT + max(2, c.window):
        return None
    recent, before = pts[-SHORT:], pts[-SHORT - c.window : -SHORT]
    now, prev = _mean(recent), _mean(before)
    spread = statistics.pstdev([v for _, v in before])
    se = spread * math.sqrt(1 / SHORT + 1 / len(before))
    drop = prev - now
    thr = max(c.reward_drop, c.z * se)
    return Finding(
        drop > thr,
        drop,
        thr,
        f"mean reward {_fmt(now)} over the last {SHORT} steps, {_fmt(prev)} over the "
        f"{len(before)} before: a fall of {_fmt(drop)} (alarm above {_fmt(thr)} = max("
        f"reward_drop, {c.z} standard errors))",
        pts[-SHORT - c.window :],
    )


def reward_saturation(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    recent = h.last("reward", c.window)
    if len(recent) < c.window:
        return None
    now = _mean(recent)
    return Finding(
        now >= c.reward_saturation,
        now,
        c.reward_saturation,
        f"mean reward {_fmt(now)} over the last {len(recent)} steps: little left to learn "
        "from these prompts",
        recent,
    )


def length_blowup(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    pts = h.get("length")
    if len(pts) < c.baseline_steps + 1:
        return None
    base = statistics.median(v for _, v in pts[: c.baseline_steps])
    recent = pts[c.baseline_steps :][-c.window :]
    now = _mean(recent)
    thr = c.length_blowup_ratio * base
    return Finding(
        now > thr,
        now,
        thr,
        f"mean response length {_fmt(now)} tokens over the last {len(recent)} steps; "
        f"baseline {_fmt(base)} (median of the first {c.baseline_steps}), alarm above "
        f"{c.length_blowup_ratio} x baseline",
        recent,
    )


def truncation_rise(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    pts = h.get("truncation")
    if len(pts) < c.baseline_steps + 1:
        return None
    base = statistics.median(v for _, v in pts[: c.baseline_steps])
    recent = pts[c.baseline_steps :][-c.window :]
    now = _mean(recent)
    thr = max(c.truncation_rate, base + c.truncation_rise)
    return Finding(
        now >= thr,
        now,
        thr,
        f"{_fmt(100 * now)}% of responses cut at max_new_tokens over the last "
        f"{len(recent)} steps; baseline {_fmt(100 * base)}%",
        recent,
    )


def truncation_high(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    if c.truncation_high_share is None:
        return None
    recent = h.last("truncation", c.window)
    if not recent:
        return None
    now = _mean(recent)
    return Finding(
        now > c.truncation_high_share,
        now,
        c.truncation_high_share,
        f"{_fmt(100 * now)}% of the samples hit gconfig.max_new_tokens (no EOS) over the "
        f"last {len(recent)} steps (alarm above {_fmt(100 * c.truncation_high_share)}%, "
        "run_health.truncation_high_share)",
        recent,
    )


def _fast(name: str, what: str, dev: Callable[[float], float], thr_of: str):
    """A detector on the mean of the last ``SHORT`` values of ``name``: ``dev(mean) > thr``."""

    def detect(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
        recent = h.last(name, SHORT)
        if not recent:
            return None
        now = _mean(recent)
        d = dev(now)
        thr = float(getattr(c, thr_of))
        return Finding(
            d > thr,
            now,
            thr,
            f"{what} {_fmt(now)} (mean of the last {len(recent)} measured steps); alarm "
            f"when {thr_of} = {_fmt(thr)} is exceeded",
            recent,
        )

    detect.__name__ = name
    return detect


importance_weight_blowup = _fast(
    "importance_weight",
    "mean importance weight",
    lambda v: abs(v - 1.0),
    "importance_weight_deviation",
)
kl_blowup = _fast("kl", "mean approximate KL of the update", abs, "kl_max")
clip_fraction = _fast("clip_fraction", "share of clipped tokens", lambda v: v, "clip_fraction_max")
logprob_mismatch = _fast(
    "logprob_mismatch",
    "mean |trainer - server| logprob on current-version tokens",
    lambda v: v,
    "logprob_mismatch_max",
)


def no_signal_groups(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    recent = h.last("no_signal_share", c.window)
    if not recent:
        return None
    now = _mean(recent)
    return Finding(
        now >= c.no_signal_share,
        now,
        c.no_signal_share,
        f"{_fmt(100 * now)}% of the groups had all rewards equal (no advantage, no "
        f"gradient) over the last {len(recent)} steps",
        recent,
    )


def _fall_while_reward_rises(
    h: SignalHistory, c: RunHealthConfig, name: str, what: str
) -> Finding | None:
    """``name`` fell from its best earlier value by ``heldout_drop`` and ``z`` binomial
    standard errors while the train reward rose by ``heldout_train_rise``."""
    pts = h.get(name)
    rewards = h.get("reward")
    if len(pts) < 2 or not rewards:
        return None
    last_step, last = pts[-1]
    best_step, best = max(reversed(pts[:-1]), key=lambda p: p[1])  # ties: the latest
    ns = dict(h.get("heldout_n"))
    n = ns.get(last_step, 0.0) if name == "heldout" else 0.0
    se = 0.0
    if n > 0 and 0.0 <= best <= 1.0 and 0.0 <= last <= 1.0:
        se = math.sqrt(best * (1 - best) / n + last * (1 - last) / n)
    thr = max(c.heldout_drop, c.z * se)
    drop = best - last
    # the evaluation before training (step -1) has no train reward before it: the first ones
    around_best = [p for p in rewards if p[0] <= best_step][-c.window :] or rewards[: c.window]
    now = [p for p in rewards if p[0] <= last_step][-c.window :]
    if not around_best or not now:
        return None
    rise = _mean(now) - _mean(around_best)
    firing = drop > thr and rise >= c.heldout_train_rise
    return Finding(
        firing,
        last,
        best - thr,
        f"{what} {_fmt(last)} at step {last_step}, best {_fmt(best)} at step {best_step} "
        f"(a fall of {_fmt(drop)}, alarm above {_fmt(thr)}), while the train reward rose "
        f"by {_fmt(rise)} (alarm at {c.heldout_train_rise})",
        pts[-c.window :],
    )


def heldout_divergence(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    return _fall_while_reward_rises(h, c, "heldout", "held-out accuracy")


def reward_hacking(h: SignalHistory, c: RunHealthConfig) -> Finding | None:
    """The probe: reward explained by response length, or an independent verifier
    falling while the reward rises."""
    found: list[Finding] = []
    recent = h.last("reward_length_corr", c.window)
    if len(recent) >= min(c.window, 2):
        now = _mean(recent)
        found.append(
            Finding(
                now > c.hacking_length_corr,
                now,
                c.hacking_length_corr,
                f"reward-length correlation {_fmt(now)} within the batches of the last "
                f"{len(recent)} steps: the reward pays for length",
                recent,
            )
        )
    if c.verifier_key:
        f = _fall_while_reward_rises(h, c, "verifier", f"verifier score ({c.verifier_key})")
        if f is not None:
            found.append(f)
    if not found:
        return None
    firing = [f for f in found if f.firing]
    return firing[0] if firing else found[0]


@dataclass(frozen=True)
class Detector:
    name: str
    metric: str  # the signal it mainly reads (health.jsonl "metric")
    fn: Callable[[SignalHistory, Any], Finding | None]
    suggestion: str
    #: ``bad(value, threshold)``: one step's value of ``metric`` is past the alarm's
    #: threshold (None: the alarm judges several values together). A rollback restores
    #: no checkpoint whose weights measured a bad value.
    bad: Callable[[float, float], bool] | None = None


DETECTORS: tuple[Detector, ...] = (
    Detector(
        "entropy_collapse",
        "entropy",
        entropy_collapse,
        "lower the learning rate, raise the sampling temperature or add an entropy bonus; "
        "check the reward is not satisfied by one fixed answer",
        bad=lambda v, thr: v < thr,
    ),
    Detector(
        "reward_drop",
        "reward",
        reward_drop,
        "roll back to the last good checkpoint with a lower learning rate; look at the "
        "samples of the last steps (generated/)",
    ),
    Detector(
        "reward_saturation",
        "reward",
        reward_saturation,
        "the prompts are solved: use harder data or stop; nothing is wrong",
    ),
    Detector(
        "length_blowup",
        "length",
        length_blowup,
        "check the reward does not pay for length (reward_hacking), add an overlong "
        "penalty (actor.overlong_reward_penalty) or lower the learning rate",
        bad=lambda v, thr: v > thr,
    ),
    Detector(
        "truncation_rise",
        "truncation",
        truncation_rise,
        "responses hit max_new_tokens: raise gconfig.max_new_tokens, mask truncated "
        "responses (actor.mask_no_eos_with_zero) or penalise overlong ones",
        bad=lambda v, thr: v >= thr,
    ),
    Detector(
        "truncation_high",
        "truncation",
        truncation_high,
        "answers are cut before they end, so the reward cannot read them: raise "
        "gconfig.max_new_tokens, or use a prompt that asks for a short answer; "
        "actor.mask_no_eos_with_zero gives cut answers reward 0",
    ),
    Detector(
        "importance_weight_blowup",
        "importance_weight",
        importance_weight_blowup,
        "the update moves the policy too far: lower the learning rate, use more "
        "minibatches or a tighter eps_clip; check actor.rejection_sampling",
        bad=lambda v, thr: abs(v - 1.0) > thr,
    ),
    Detector(
        "kl_blowup",
        "kl",
        kl_blowup,
        "lower the learning rate or ppo_n_minibatches' step size; roll back if it persists",
        bad=lambda v, thr: abs(v) > thr,
    ),
    Detector(
        "clip_fraction",
        "clip_fraction",
        clip_fraction,
        "most tokens are clipped: the learning rate is too high for eps_clip, or the "
        "rollouts are too stale (rollout.max_head_offpolicyness)",
        bad=lambda v, thr: v > thr,
    ),
    Detector(
        "logprob_mismatch",
        "logprob_mismatch",
        logprob_mismatch,
        "the servers do not run the trainer's weights: enable rollout.verify_weights, "
        "check the weight sync and the dtype/kernels of both sides",
        bad=lambda v, thr: v > thr,
    ),
    Detector(
        "no_signal_groups",
        "no_signal_share",
        no_signal_groups,
        "most groups teach nothing: use harder (or easier) prompts, more samples per "
        "prompt, or actor.dynamic_sampling",
    ),
    Detector(
        "heldout_divergence",
        "heldout",
        heldout_divergence,
        "the policy overfits the train reward: stop or roll back, check the reward "
        "against the held-out metric",
    ),
    Detector(
        "reward_hacking",
        "reward_length_corr",
        reward_hacking,
        "the reward is gamed (it follows length or disagrees with the verifier): fix the "
        "reward function, then roll back",
    ),
)
