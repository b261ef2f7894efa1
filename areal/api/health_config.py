"""Run health: the per-step alarms of an RL run (``RunHealthConfig``, the ``run_health``
section of ``PPOConfig`` / ``GRPOConfig``; ``areal.utils.run_health``, docs/run_health.md).

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.api.config_common import cfield, check_choice, check_range

#: alarms that call for a decision (their ``actions`` apply)
ACTIONABLE_ALARMS = (
    "entropy_collapse",
    "reward_drop",
    "length_blowup",
    "truncation_rise",
    "importance_weight_blowup",
    "kl_blowup",
    "clip_fraction",
    "logprob_mismatch",
    "heldout_divergence",
    "reward_hacking",
)
#: alarms a converging run reaches normally (logged, never acted on)
INFORMATIONAL_ALARMS = ("reward_saturation", "no_signal_groups", "truncation_high")
#: informational alarms whose start is logged as a WARNING: a setting to change, from the
#: first step on, not a state a converging run reaches
WARNING_ALARMS = ("truncation_high",)
ALARMS = ACTIONABLE_ALARMS + INFORMATIONAL_ALARMS
HEALTH_ACTIONS = ("warn", "stop", "rollback")


@dataclass
class RunHealthConfig:
    """Per-step checks on the statistics the trainer already has; each alarm is logged
    once when it starts and once when it clears (``health.jsonl``, ``health/<alarm>`` in
    the stats). Thresholds are conservative: an unmodified run should raise none of the
    actionable alarms."""

    enabled: bool = cfield(True, "Run the checks every training step.")
    action: str = cfield(
        "warn",
        "What an actionable alarm does when it starts: 'warn' (log it), 'stop' (end the run "
        "cleanly after this step, no recover checkpoint of it), 'rollback' (restore the last "
        "recover checkpoint from before the alarm, multiply the learning rate by "
        "rollback_lr_factor, continue). Informational alarms are only logged.",
        choices=list(HEALTH_ACTIONS),
    )
    actions: dict[str, str] | None = cfield(
        None,
        "Per-alarm actions overriding `action`, e.g. {entropy_collapse: rollback, "
        "logprob_mismatch: stop} (command line: run_health.actions.entropy_collapse=rollback); "
        "keys are actionable alarm names.",
    )
    window: int = cfield(4, "Steps averaged for the current value of a metric; >= 1.")
    baseline_steps: int = cfield(
        3,
        "The median of the first this many measured steps is a metric's baseline (entropy, "
        "length, truncation); >= 1.",
    )
    clear_steps: int = cfield(
        2, "An alarm clears after this many consecutive steps without its condition; >= 1."
    )
    entropy_collapse_ratio: float = cfield(
        0.2,
        "entropy_collapse: the mean token entropy of the last 2 steps is below this "
        "fraction of its baseline; in (0, 1).",
    )
    reward_drop: float = cfield(
        0.3,
        "reward_drop: the mean reward of the last 2 steps is this much (reward units) below "
        "that of the `window` steps before, and by more than `z` standard errors; > 0.",
    )
    reward_saturation: float = cfield(
        0.95,
        "reward_saturation (informational): the mean reward of the last `window` steps is "
        "at least this (rewards in [0, 1]).",
    )
    length_blowup_ratio: float = cfield(
        2.0,
        "length_blowup: the mean response length of the last `window` steps exceeds this "
        "multiple of its baseline; > 1.",
    )
    truncation_rate: float = cfield(
        0.3,
        "truncation_rise: the share of responses cut at max_new_tokens (mean of the last "
        "`window` steps) is at least this and at least truncation_rise above its baseline; "
        "in (0, 1].",
    )
    truncation_rise: float = cfield(
        0.2, "truncation_rise: the rise over the baseline truncation share; in (0, 1]."
    )
    truncation_high_share: float | None = cfield(
        0.5,
        "truncation_high (informational, logged as a WARNING; from the first step on, no "
        "baseline needed): more than this share of the samples hit gconfig.max_new_tokens "
        "(no EOS; mean of the last `window` steps, the first step alone at first): answers "
        "are cut before their end, so the reward cannot read them. Logged once when it "
        "starts (again only after it cleared). null: off; in (0, 1].",
    )
    importance_weight_deviation: float = cfield(
        0.5,
        "importance_weight_blowup: |mean importance weight - 1| (update over proximal policy, "
        "mean of the last 2 steps) exceeds this; > 0.",
    )
    kl_max: float = cfield(
        0.2,
        "kl_blowup: |mean approximate KL| of the update (last 2 steps) exceeds this; > 0.",
    )
    clip_fraction_max: float = cfield(
        0.3,
        "clip_fraction: the share of clipped tokens (mean of the last 2 steps) exceeds "
        "this; in (0, 1].",
    )
    logprob_mismatch_max: float = cfield(
        0.1,
        "logprob_mismatch: the mean |trainer - server| logprob on tokens sampled with the "
        "trainer's current weights (consistency/logp_absdiff_avg, last 2 measured steps) "
        "exceeds this (nats); > 0.",
    )
    no_signal_share: float = cfield(
        0.6,
        "no_signal_groups (informational): the share of groups whose rewards are all equal "
        "(dynamically filtered groups included; mean of the last `window` steps) is at "
        "least this; in (0, 1].",
    )
    heldout_drop: float = cfield(
        0.1,
        "heldout_divergence: the held-out accuracy fell this much below its best earlier "
        "evaluation (and by more than `z` standard errors) while the train reward rose "
        "by heldout_train_rise; > 0.",
    )
    heldout_train_rise: float = cfield(
        0.05,
        "heldout_divergence: the rise of the train reward (mean of the last `window` "
        "steps over that around the best evaluation); >= 0.",
    )
    hacking_length_corr: float = cfield(
        0.8,
        "reward_hacking: the correlation of reward and response length within a batch "
        "(mean of the last `window` steps) exceeds this; in (0, 1].",
    )
    verifier_key: str | None = cfield(
        None,
        "reward_hacking: a stats key of an independent verifier's score (e.g. a second "
        "reward function logged by the workflow); the alarm also starts when the train "
        "reward rises by heldout_train_rise while that score falls by heldout_drop. None: "
        "only the length probe.",
    )
    z: float = cfield(
        3.0,
        "Standard errors a fall (reward_drop, heldout_divergence, verifier) must exceed to "
        "count, from the spread of the recent values resp. the binomial error; >= 0.",
    )
    rollback_lr_factor: float = cfield(
        0.5, "rollback: the learning rate is multiplied by this after a rollback; in (0, 1]."
    )
    rollback_margin_steps: int = cfield(
        2,
        "rollback: the checkpoint restored is of a step before start - 1 - this - lag "
        "(lag: rollout.max_head_offpolicyness when asynchronous, else 0; the statistics of "
        "step s measure the weights of step s - 1 and a detector averages a few steps, so "
        "the first bad weights can predate the alarm); with rollback the recover handler "
        "keeps that margin + 3 checkpoints; >= 0.",
    )
    max_rollbacks: int = cfield(
        2, "rollback: after this many rollbacks a further rollback alarm stops the run; >= 0."
    )

    def __post_init__(self):
        owner = "RunHealthConfig"
        check_choice(owner, "action", self.action, list(HEALTH_ACTIONS))
        for name, value in (self.actions or {}).items():
            if name not in ACTIONABLE_ALARMS:
                raise ValueError(
                    f"{owner}.actions has key {name!r}; allowed: {list(ACTIONABLE_ALARMS)} "
                    f"(informational alarms {list(INFORMATIONAL_ALARMS)} are never acted on)"
                )
            check_choice(owner, f"actions.{name}", value, list(HEALTH_ACTIONS))
        for name in ("window", "baseline_steps", "clear_steps"):
            check_range(owner, name, getattr(self, name), ge=1)
        check_range(owner, "entropy_collapse_ratio", self.entropy_collapse_ratio, gt=0, lt=1)
        check_range(owner, "reward_drop", self.reward_drop, gt=0)
        check_range(owner, "length_blowup_ratio", self.length_blowup_ratio, gt=1)
        for name in (
            "truncation_rate",
            "truncation_rise",
            "clip_fraction_max",
            "no_signal_share",
            "hacking_length_corr",
        ):
            check_range(owner, name, getattr(self, name), gt=0, le=1)
        check_range(
            owner, "truncation_high_share", self.truncation_high_share, gt=0, le=1, optional=True
        )
        for name in ("importance_weight_deviation", "kl_max", "logprob_mismatch_max"):
            check_range(owner, name, getattr(self, name), gt=0)
        check_range(owner, "heldout_drop", self.heldout_drop, gt=0)
        check_range(owner, "heldout_train_rise", self.heldout_train_rise, ge=0)
        check_range(owner, "z", self.z, ge=0)
        check_range(owner, "rollback_lr_factor", self.rollback_lr_factor, gt=0, le=1)
        check_range(owner, "rollback_margin_steps", self.rollback_margin_steps, ge=0)
        check_range(owner, "max_rollbacks", self.max_rollbacks, ge=0)

    def action_for(self, alarm: str) -> str:
        """The action of ``alarm`` (``warn`` for informational alarms)."""
        if alarm not in ACTIONABLE_ALARMS:
            return "warn"
        return (self.actions or {}).get(alarm, self.action)

    def uses_rollback(self) -> bool:
        return self.action == "rollback" or "rollback" in (self.actions or {}).values()
