"""Algorithm configs of trained models: ``PPOActorConfig`` (with ``RejectionSamplingConfig``), ``PPOCriticConfig``, ``TeacherConfig``, ``DPOEngineConfig``.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from areal.api.config_common import cfield, check_choice, check_range, warn_once
from areal.api.engine_config import NormConfig, TrainEngineConfig

_PROX_LOGP_METHODS = ["recompute", "loglinear", "metrics", "reuse_train_logp"]


_BEHAVE_IMP_WEIGHT_MODES = [
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "disabled",
]


_RS_LEVELS = ["token", "sequence"]


_RS_ACTIONS = ["mask", "clamp"]


_RS_METRICS = ["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"]


_RS_AGGS = ["sum", "mean", "max"]


@dataclass
class RejectionSamplingConfig:
    """Filtering of stale samples in the decoupled loss, by how far the proximal policy
    has moved from the behaviour policy that generated them.

    With r = pi_prox / pi_behave per token, the metric is r itself ('ratio') or a KL
    estimate: k1 = log r, k2 = (log r)^2 / 2, k3 = r - log r - 1; or 'binary_kl' (KPop):
    each token's probability seen as a Bernoulli, max(KL(p_prox || p_behave),
    KL(p_behave || p_prox)) with KL(p || q) = p log(p/q) + (1-p) log((1-p)/(1-q)). At
    'sequence' level the
    per-token values of a sequence are aggregated ('sum' / 'mean' of log r for 'ratio',
    i.e. a product / geometric mean; arithmetic for KL; or 'max') and the whole sequence
    shares one decision. 'mask' removes tokens (sequences) outside [lower, upper] from
    the loss; 'clamp' (ratio only) clamps the importance weight into [lower, upper].
    Replaces the legacy ``behave_imp_weight_cap`` / ``behave_imp_weight_mode``.
    """

    level: str = cfield(
        "token",
        "'token': each token judged on its own; 'sequence': one decision per sequence "
        "(with metric 'ratio' the correction weight is the sequence's aggregated ratio too).",
        choices=_RS_LEVELS,
    )
    action: str = cfield(
        "mask",
        "'mask': drop tokens/sequences outside the bounds from the loss; 'clamp': clamp "
        "the importance weight into [lower, upper] (metric 'ratio' only).",
        choices=_RS_ACTIONS,
    )
    metric: str = cfield(
        "ratio",
        "'ratio' (pi_prox / pi_behave), 'kl_k1' (log r, may be negative), 'kl_k2' "
        "((log r)^2 / 2), 'kl_k3' (r - log r - 1), 'binary_kl' (KPop: the larger of the "
        "two binary KL divergences between the token's probabilities under the proximal "
        "and the behaviour policy).",
        choices=_RS_METRICS,
    )
    agg: str = cfield(
        "mean",
        "Sequence-level aggregation: 'sum', 'mean' (in log space for 'ratio': product / "
        "geometric mean) or 'max'. Ignored at level 'token'.",
        choices=_RS_AGGS,
    )
    upper: float = cfield(
        5.0,
        "Upper bound: values above it are filtered (or clamped). > 1 for 'ratio', > 0 for "
        "'kl_k2' / 'kl_k3' / 'binary_kl'.",
    )
    lower: float | None = cfield(
        None,
        "Lower bound; None: none ('clamp' sets it to 0.0). > 0 for 'ratio' (0.0 allowed "
        "with 'clamp'); <= upper.",
    )

    def __post_init__(self):
        owner = "RejectionSamplingConfig"
        check_choice(owner, "level", self.level, _RS_LEVELS)
        check_choice(owner, "action", self.action, _RS_ACTIONS)
        check_choice(owner, "metric", self.metric, _RS_METRICS)
        check_choice(owner, "agg", self.agg, _RS_AGGS)
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(
                f"{owner}.lower={self.lower!r} is not allowed; must be <= upper={self.upper!r}"
            )
        if self.metric == "ratio":
            if self.upper <= 1.0:
                raise ValueError(
                    f"{owner}.upper={self.upper!r} is not allowed with metric='ratio'; must be "
                    "> 1 (otherwise every token whose policy changed at all is filtered)"
                )
            # 0.0 is what 'clamp' fills in for "no lower bound"; a saved config holds it.
            floor_ok = self.action == "clamp" and self.lower == 0.0
            if self.lower is not None and self.lower <= 0 and not floor_ok:
                raise ValueError(
                    f"{owner}.lower={self.lower!r} is not allowed with metric='ratio'; must be "
                    "> 0 (or 0.0 with action='clamp')"
                )
        if self.metric in ("kl_k2", "kl_k3", "binary_kl") and self.upper <= 0:
            raise ValueError(
                f"{owner}.upper={self.upper!r} is not allowed with metric={self.metric!r}; "
                "must be > 0"
            )
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"{owner}.action='clamp' is not allowed with metric={self.metric!r}; clamping "
                "applies to the importance ratio only (metric='ratio'); use action='mask'"
            )
        if self.action == "clamp" and self.lower is None:
            self.lower = 0.0
        if self.level == "token" and self.agg != "mean":
            warn_once(
                f"rs-agg-{self.agg}",
                f"{owner}.agg={self.agg!r} is ignored with level='token' (aggregation "
                "applies to level='sequence' only)",
            )


def legacy_rejection_sampling(
    cap: float | None, mode: str | None
) -> RejectionSamplingConfig | None:
    """The ``rejection_sampling`` equivalent of legacy ``behave_imp_weight_cap`` / ``_mode``.

    'token_mask' / 'token_truncate' / 'sequence_mask' / 'sequence_truncate' with cap X ->
    ``{level: token|sequence, action: mask|clamp, metric: ratio, upper: X}``; 'disabled'
    or no cap -> None (no filtering). ``mode=None`` means 'token_mask'.
    """
    mode = mode or "token_mask"
    check_choice("PPOActorConfig", "behave_imp_weight_mode", mode, _BEHAVE_IMP_WEIGHT_MODES)
    if mode == "disabled" or cap is None:
        return None
    level, how = mode.split("_", 1)
    return RejectionSamplingConfig(
        level=level, action="mask" if how == "mask" else "clamp", metric="ratio", upper=cap
    )


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy model of PPO/GRPO and its loss: clipping, rewards, advantages, KL, async corrections."""

    # ---- core PPO / GRPO
    group_size: int = cfield(
        1,
        "Samples per prompt in a batch (usually gconfig.n_samples); used by group statistics; >= 1.",
    )
    ppo_n_minibatches: int = cfield(
        4,
        "Each training batch is split into this many mini-batches, one optimizer step each; >= 1.",
    )
    eps_clip: float = cfield(
        0.2,
        "PPO clip range of the probability ratio (lower side when eps_clip_higher is set); >= 0.",
    )
    eps_clip_higher: float | None = cfield(
        None, "Upper clip range (DAPO clip-higher); None uses eps_clip on both sides; >= 0."
    )
    c_clip: float | None = cfield(
        None, "Dual-clip bound for negative advantages; > 1. None disables dual clipping."
    )
    # ---- rewards
    reward_scaling: float = cfield(
        1.0, "Rewards are multiplied by this factor (after adding reward_bias)."
    )
    reward_bias: float = cfield(0.0, "Added to every reward before scaling.")
    reward_clip: float = cfield(20.0, "Rewards are clipped to [-reward_clip, reward_clip]; > 0.")
    reward_norm: NormConfig | None = cfield(
        None, "Reward normalisation (e.g. per group for GRPO); None: off."
    )
    overlong_reward_penalty: bool = cfield(
        False, "DAPO soft overlong penalty on responses close to max_new_tokens."
    )
    overlong_tokens: int | None = cfield(
        None,
        "Length of the penalised tail before max_new_tokens; required with overlong_reward_penalty.",
    )
    overlong_penalty_factor: float | None = cfield(
        None, "Maximum penalty of the overlong tail; required with overlong_reward_penalty."
    )
    mask_no_eos_with_zero: bool = cfield(
        False, "Exclude truncated responses (no EOS) from the loss."
    )
    # ---- advantages
    discount: float = cfield(1.0, "Discount factor gamma of future rewards, in [0, 1].")
    gae_lambda: float | str = cfield(
        1.0,
        "GAE lambda, in [0, 1]; or the dotted path of a function giving one lambda per "
        "sequence (e.g. areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae), called with "
        "the batch's lengths and gae_lambda_kwargs.",
    )
    gae_lambda_kwargs: dict[str, Any] = cfield(
        help="Keyword arguments of a gae_lambda function (e.g. {alpha: 0.05}); ignored "
        "when gae_lambda is a number.",
        factory=dict,
    )
    gae_timestep_unit: str = cfield(
        "token",
        "GAE timestep: 'token' (discount and lambda per generated token) or 'turn' (per "
        "generated turn: a run of consecutive loss tokens, or the batch's turn_ids).",
        choices=["token", "turn"],
    )
    adv_norm: NormConfig | None = cfield(None, "Advantage normalisation; None: off.")
    # ---- KL
    kl_ctl: float = cfield(
        0.1, "Coefficient of the KL penalty against the reference model; >= 0 (0 = no KL)."
    )
    kl_estimator: str = cfield(
        "k1",
        "KL estimator: 'k1' (log-ratio), 'k2' (squared log-ratio / 2), 'k3' (Schulman's unbiased).",
        choices=["k1", "k2", "k3"],
    )
    # ---- asynchronous RL
    recompute_logprob: bool = cfield(
        False, "Recompute token logprobs with the training engine before the update."
    )
    use_decoupled_loss: bool = cfield(
        False,
        "Decoupled PPO objective (AReaL): clip against the proximal policy and weight by "
        "the behaviour importance ratio. Implies recompute_logprob=True.",
    )
    rejection_sampling: RejectionSamplingConfig | None = cfield(
        None,
        "Filtering of stale samples by the proximal/behaviour divergence (decoupled loss "
        "only); None: no filtering.",
    )
    behav_imp_weight_cap: float | None = cfield(
        None,
        "DEPRECATED (use rejection_sampling): cap of the behaviour importance weight; > 1. "
        "Migrated into rejection_sampling with a warning.",
    )
    behave_imp_weight_cap: float | None = cfield(
        None,
        "DEPRECATED (use rejection_sampling): later spelling of behav_imp_weight_cap; takes "
        "precedence over it.",
    )
    behave_imp_weight_mode: str = cfield(
        "token_mask",
        "DEPRECATED (use rejection_sampling): 'token_mask', 'token_truncate', "
        "'sequence_mask', 'sequence_truncate' or 'disabled'; with a cap X migrated to "
        "rejection_sampling {level, action: mask|clamp, metric: ratio, upper: X}.",
        choices=_BEHAVE_IMP_WEIGHT_MODES,
    )
    importance_sampling_level: str = cfield(
        "token",
        "'token': per-token ratios (PPO); 'sequence': geometric mean of the ratios over a "
        "sequence (GSPO).",
        choices=["token", "sequence"],
    )
    prox_logp_method: str = cfield(
        "recompute",
        "How the proximal logprobs of the decoupled loss are obtained: 'recompute' (forward "
        "pass), 'loglinear' (interpolated, no forward pass), 'metrics' (recompute and log "
        "the interpolation error), 'reuse_train_logp' (the training forward pass's own "
        "logprobs, detached: no extra forward; needs ppo_n_minibatches=1, forced with a "
        "warning).",
        choices=_PROX_LOGP_METHODS,
    )
    # ---- algorithm variants
    m2_threshold: float | None = cfield(
        None,
        "M2PO: tokens are masked, largest squared log-ratio first, until the batch's second "
        "moment of the log-ratio is at most this threshold; > 0. None: M2PO off.",
    )
    use_sapo_loss: bool = cfield(
        False,
        "SAPO: replace hard ratio clipping by a smooth sigmoid gate of the ratio. "
        "Incompatible with use_decoupled_loss.",
    )
    sapo_tau_pos: float = cfield(1.0, "SAPO gate temperature for positive advantages; > 0.")
    sapo_tau_neg: float = cfield(1.05, "SAPO gate temperature for negative advantages; > 0.")
    use_cispo_loss: bool = cfield(
        False,
        "CISPO (MiniMax-M1): the token loss is -sg(clip(r, 1 - eps_clip, 1 + eps_clip_higher)) "
        "* A * log pi, so every token keeps its gradient (the clipped IS weight carries none). "
        "Needs eps_clip_higher > 0 and importance_sampling_level='token'; excludes "
        "use_sapo_loss. Typical: eps_clip=1.0 (no lower bound), eps_clip_higher=4.0.",
    )
    dynamic_sampling: bool = cfield(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal (variable batch size).",
    )
    # ---- logging and others
    log_agent_stats: bool = cfield(False, "Log extra per-trajectory statistics of agent workflows.")
    log_agent_stats_keys: list[str] = cfield(
        help="Keys of the trajectory dict logged when log_agent_stats.", factory=list
    )
    max_new_tokens: int = cfield(
        1024,
        "Generation length limit (usually ${gconfig.max_new_tokens}); used by overlong penalties.",
    )
    loss_agg_mode: str = cfield(
        "token-mean",
        "How token losses are reduced: 'token-mean' (mean over all loss tokens), "
        "'seq-mean-token-mean' (token mean per sequence, then mean over sequences), "
        "'seq-mean-token-sum-norm' (token sum per sequence / loss_norm_constant, mean over "
        "sequences; Dr.GRPO).",
        choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    )
    loss_norm_constant: float | None = cfield(
        None, "Constant divisor of 'seq-mean-token-sum-norm'; None: max_new_tokens; > 0."
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        check_range(owner, "group_size", self.group_size, ge=1)
        check_range(owner, "ppo_n_minibatches", self.ppo_n_minibatches, ge=1)
        check_range(owner, "eps_clip", self.eps_clip, ge=0)
        check_range(owner, "eps_clip_higher", self.eps_clip_higher, ge=0, optional=True)
        check_range(owner, "c_clip", self.c_clip, gt=1, optional=True)
        check_range(owner, "reward_clip", self.reward_clip, gt=0)
        check_range(owner, "discount", self.discount, ge=0, le=1)
        if isinstance(self.gae_lambda, str):
            if not self.gae_lambda.strip():
                raise ValueError(
                    f"{owner}.gae_lambda='' is not allowed; give a number in [0, 1] or the "
                    "dotted path of a lambda function"
                )
        else:
            check_range(owner, "gae_lambda", self.gae_lambda, ge=0, le=1)
        check_choice(owner, "gae_timestep_unit", self.gae_timestep_unit, ["token", "turn"])
        check_range(owner, "kl_ctl", self.kl_ctl, ge=0)
        check_choice(owner, "kl_estimator", self.kl_estimator, ["k1", "k2", "k3"])
        check_choice(
            owner,
            "importance_sampling_level",
            self.importance_sampling_level,
            ["token", "sequence"],
        )
        check_choice(owner, "prox_logp_method", self.prox_logp_method, _PROX_LOGP_METHODS)
        check_choice(
            owner, "behave_imp_weight_mode", self.behave_imp_weight_mode, _BEHAVE_IMP_WEIGHT_MODES
        )
        if self.behave_imp_weight_cap is not None:
            self.behav_imp_weight_cap = self.behave_imp_weight_cap
        check_range(owner, "behav_imp_weight_cap", self.behav_imp_weight_cap, gt=1, optional=True)
        self._migrate_legacy_rejection_sampling()
        check_range(owner, "m2_threshold", self.m2_threshold, gt=0, optional=True)
        check_range(owner, "max_new_tokens", self.max_new_tokens, ge=1)
        check_choice(
            owner,
            "loss_agg_mode",
            self.loss_agg_mode,
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
        )
        check_range(owner, "loss_norm_constant", self.loss_norm_constant, gt=0, optional=True)
        if self.use_decoupled_loss:
            # As AReaL: the decoupled loss implies recompute_logprob.
            self.recompute_logprob = True
            if self.rejection_sampling is None:
                warn_once(
                    "decoupled-no-rs",
                    f"{owner}.use_decoupled_loss=True with rejection_sampling=None: stale "
                    "samples are not filtered. The former default (cap 5.0, token_mask) is "
                    "rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0}",
                )
        elif self.rejection_sampling is not None:
            warn_once(
                "rs-without-decoupled",
                f"{owner}.rejection_sampling is set but use_decoupled_loss=False; it is ignored",
            )
        if self.use_sapo_loss:
            check_range(owner, "sapo_tau_pos", self.sapo_tau_pos, gt=0)
            check_range(owner, "sapo_tau_neg", self.sapo_tau_neg, gt=0)
            if self.use_decoupled_loss:
                raise ValueError(
                    f"{owner}.use_sapo_loss=True is incompatible with {owner}.use_decoupled_loss=True; "
                    "set one of them to false"
                )
        if self.use_cispo_loss:
            self._check_cispo(owner)
        if self.prox_logp_method == "reuse_train_logp" and self.ppo_n_minibatches > 1:
            # As AReaL: with several optimizer steps the training forward no longer sees
            # the proximal (update-start) weights after the first mini-batch.
            warn_once(
                "reuse-train-logp-minibatches",
                f"{owner}.prox_logp_method='reuse_train_logp' needs ppo_n_minibatches=1 (the "
                "training forward pass is the proximal policy only before the first "
                f"optimizer step); got {self.ppo_n_minibatches}, using 1",
            )
            self.ppo_n_minibatches = 1
        if self.overlong_reward_penalty:
            if self.overlong_tokens is None or self.overlong_penalty_factor is None:
                raise ValueError(
                    f"{owner}.overlong_reward_penalty=True requires overlong_tokens and "
                    f"overlong_penalty_factor (got {self.overlong_tokens!r}, {self.overlong_penalty_factor!r})"
                )
            check_range(owner, "overlong_tokens", self.overlong_tokens, ge=1)
            check_range(owner, "overlong_penalty_factor", self.overlong_penalty_factor, ge=0)

    def _check_cispo(self, owner: str) -> None:
        if self.use_sapo_loss:
            raise ValueError(
                f"{owner}.use_cispo_loss=True and use_sapo_loss=True are mutually exclusive "
                "surrogates; set at most one of them"
            )
        if self.eps_clip_higher is None or self.eps_clip_higher <= 0:
            raise ValueError(
                f"{owner}.eps_clip_higher={self.eps_clip_higher!r} is not allowed with "
                "use_cispo_loss=True; CISPO needs a positive upper clip of the IS weight "
                "(e.g. eps_clip=1.0, eps_clip_higher=4.0)"
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"{owner}.importance_sampling_level={self.importance_sampling_level!r} is not "
                "allowed with use_cispo_loss=True; CISPO is defined per token ('token')"
            )

    def _migrate_legacy_rejection_sampling(self) -> None:
        legacy_set = (
            self.behav_imp_weight_cap is not None or self.behave_imp_weight_mode != "token_mask"
        )
        if not legacy_set:
            return
        migrated = legacy_rejection_sampling(self.behav_imp_weight_cap, self.behave_imp_weight_mode)
        if self.rejection_sampling is not None and self.rejection_sampling != migrated:
            raise ValueError(
                f"{type(self).__name__}: both the deprecated behave_imp_weight_cap="
                f"{self.behav_imp_weight_cap!r} / behave_imp_weight_mode="
                f"{self.behave_imp_weight_mode!r} and rejection_sampling={self.rejection_sampling!r} "
                "are set and disagree; keep only rejection_sampling"
            )
        self.rejection_sampling = migrated
        shown = (
            "null"
            if migrated is None
            else (
                f"{{level: {migrated.level}, action: {migrated.action}, metric: ratio, "
                f"upper: {migrated.upper}}}"
            )
        )
        warn_once(
            f"legacy-rs-{self.behav_imp_weight_cap}-{self.behave_imp_weight_mode}",
            "behave_imp_weight_cap / behave_imp_weight_mode (and behav_imp_weight_cap) are "
            f"deprecated; migrated to rejection_sampling: {shown}. Write that instead.",
        )

    def should_compute_prox_logp(self) -> bool:
        """Whether the training engine must recompute logprobs before the PPO update."""
        if self.use_decoupled_loss:
            return self.prox_logp_method not in ("loglinear", "reuse_train_logp")
        return self.recompute_logprob


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """The value model of PPO (trained by clipped value regression)."""

    ppo_n_minibatches: int = cfield(4, "Mini-batches per PPO update; >= 1.")
    eps_clip: float = cfield(0.5, "Clip range of the value update around the old values; > 0.")
    mask_no_eos_with_zero: bool = cfield(
        False, "Exclude truncated responses (no EOS) from the value loss."
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        check_range(owner, "ppo_n_minibatches", self.ppo_n_minibatches, ge=1)
        check_range(owner, "eps_clip", self.eps_clip, gt=0)


@dataclass
class TeacherConfig(PPOActorConfig):
    """Teacher model for on-policy distillation (``PPOConfig.teacher``): a frozen model whose
    logprobs of every trajectory enter the actor loss as a reverse-KL term."""

    rl_loss_weight: float = cfield(
        1.0, "Weight of the RL loss; 0: pure distillation (reverse KL by importance sampling)."
    )
    distill_loss_weight: float = cfield(0.005, "Weight of the distillation (reverse-KL) loss.")
    engine_type: str = cfield(
        "rollout",
        "AReaL 2.0: 'train' (the teacher is a training engine: the `train` section, or this "
        "section's own fields) or 'rollout' (scored by an inference engine, the `rollout` "
        "section). 'rollout' with `rollout.backend: local:dN`: N built-in servers of "
        "teacher.path score the tokens (POST /score); with a vllm/sglang backend a "
        "forward-only training engine with teacher.path and the actor's layout does (same "
        "values), with a warning. Without either section this section's own fields are "
        "the teacher (AReaL 1.x YAMLs).",
        choices=["rollout", "train"],
    )
    rollout: Any = cfield(
        None,
        "AReaL 2.0's inference-engine teacher (an InferenceEngineConfig-shaped section: "
        "backend, scheduling_spec, ...); see engine_type.",
    )
    train: PPOActorConfig | None = cfield(
        None, "AReaL 2.0's train-engine teacher; its fields replace this section's."
    )

    def __post_init__(self):
        check_choice("TeacherConfig", "engine_type", self.engine_type, ["rollout", "train"])
        if self.engine_type == "train" and self.train is not None:
            for f in fields(PPOActorConfig):
                setattr(self, f.name, getattr(self.train, f.name))
            self.train = None
        elif (
            self.engine_type == "rollout"
            and self.rollout is not None
            and not (str(_section_get(self.rollout, "backend") or "").startswith("local"))
        ):
            warn_once(
                "teacher-rollout",
                "teacher.engine_type='rollout': the teacher's log-probabilities come from a "
                f"forward-only training engine at teacher.path={self.path!r} (the same "
                "values an inference server would score), not from an inference server",
            )
        super().__post_init__()


def _section_get(section: Any, key: str) -> Any:
    """``section[key]`` of a mapping or ``section.key`` of an object (None when absent)."""
    if isinstance(section, dict):
        return section.get(key)
    return getattr(section, key, None)


_DPO_LOSS_TYPES = ["sigmoid", "ipo"]


@dataclass
class DPOEngineConfig(TrainEngineConfig):
    """A model of DPO training (policy or reference) and the DPO loss settings."""

    beta: float = cfield(0.1, "Strength of the implicit KL penalty of the DPO loss; > 0.")
    loss_type: str = cfield(
        "sigmoid",
        "'sigmoid' (the original DPO loss) or 'ipo' (Identity Preference Optimization, "
        "length-normalised).",
        choices=_DPO_LOSS_TYPES,
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        check_choice(owner, "loss_type", self.loss_type, _DPO_LOSS_TYPES)
        check_range(owner, "beta", self.beta, gt=0)
