"""Formula tests for areal.utils.functional against hand values and slow loop references."""

from __future__ import annotations

import math

import pytest
import torch

from areal.utils import functional as F

torch.manual_seed(0)


# ------------------------------------------------------------------ KL estimators
def test_kl_estimator_each_kind_matches_hand_values():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    d = logp - ref  # [0.5, -1.0]
    assert torch.allclose(F.kl_estimator(logp, ref, "k1"), d)
    assert torch.allclose(F.kl_estimator(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    assert torch.allclose(F.kl_estimator(logp, ref, "k3"), k3)
    assert (F.kl_estimator(torch.randn(50), torch.randn(50), "k3") >= 0).all()


def test_kl_estimator_unknown_kind_raises():
    with pytest.raises(ValueError, match="k1"):
        F.kl_estimator(torch.zeros(1), torch.zeros(1), "k4")


# ------------------------------------------------------------------ clipped surrogate
def _tok(logp_new, prox, old, adv, mask=None):
    def t(x):
        return torch.tensor(x, dtype=torch.float32)

    m = torch.ones(len(logp_new), dtype=torch.bool) if mask is None else torch.tensor(mask)
    return t(logp_new), t(prox), t(old), t(adv), m


def test_ppo_actor_loss_clipping_both_sides_matches_hand_values():
    r = torch.tensor([1.5, 0.5, 1.1, 0.7])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    prox = torch.zeros(4)
    logp = torch.log(r).requires_grad_()
    loss, st = F.ppo_actor_loss_fn(
        logp, prox, prox, adv, eps_clip=0.2, loss_mask=torch.ones(4, dtype=torch.bool)
    )
    # per-token: max(-A r, -A clip(r)):
    # r=1.5,A=1 -> max(-1.5,-1.2) = -1.2 (clipped); r=0.5,A=-1 -> max(0.5,0.8)=0.8 (clipped)
    # r=1.1,A=1 -> -1.1 ; r=0.7,A=1 -> max(-0.7,-0.8) = -0.7 (unclipped, pessimistic side)
    expected = torch.tensor([-1.2, 0.8, -1.1, -0.7])
    assert torch.allclose(st["loss"], expected, atol=1e-6)
    assert loss.item() == pytest.approx(expected.mean().item(), abs=1e-6)
    assert st["clip_mask"].tolist() == [True, True, False, False]
    loss.backward()
    # clipped tokens have zero gradient; unclipped: d(-A r)/dlogp = -A r / n
    g = logp.grad
    assert g[0] == 0 and g[1] == 0
    assert g[2].item() == pytest.approx(-1.1 / 4, rel=1e-5)
    assert g[3].item() == pytest.approx(-0.7 / 4, rel=1e-5)


def test_ppo_actor_loss_clip_higher_asymmetric_bound():
    r = torch.tensor([1.25, 1.35])
    prox = torch.zeros(2)
    _, st = F.ppo_actor_loss_fn(
        torch.log(r),
        prox,
        prox,
        torch.ones(2),
        eps_clip=0.2,
        eps_clip_higher=0.28,
        loss_mask=torch.ones(2, dtype=torch.bool),
    )
    assert torch.allclose(st["loss"], torch.tensor([-1.25, -1.28]))
    assert st["clip_mask"].tolist() == [False, True]


def test_ppo_actor_loss_dual_clip_bounds_negative_advantage():
    r = torch.tensor([5.0, 5.0, 2.0])
    adv = torch.tensor([-1.0, 1.0, -1.0])
    prox = torch.zeros(3)
    _, st = F.ppo_actor_loss_fn(
        torch.log(r),
        prox,
        prox,
        adv,
        eps_clip=0.2,
        c_clip=3.0,
        loss_mask=torch.ones(3, dtype=torch.bool),
    )
    # A<0, r=5: max(5, 1.2)=5 -> min(5, 3) = 3 (dual clipped); A>0: -1.2 unaffected;
    # A<0, r=2: max(2, 1.2)=2 < 3 -> 2
    assert torch.allclose(st["loss"], torch.tensor([3.0, -1.2, 2.0]))
    assert st["dual_clip_mask"].tolist() == [True, False, False]
    with pytest.raises(ValueError, match="c_clip"):
        F.ppo_actor_loss_fn(
            torch.zeros(1),
            torch.zeros(1),
            torch.zeros(1),
            torch.ones(1),
            0.2,
            torch.ones(1, dtype=torch.bool),
            c_clip=1.0,
        )


def test_ppo_actor_loss_decoupled_weight_and_cap_masking():
    # current == proximal (ratio 1); behaviour weights exp(prox - old) = [0.5, 2, 8]
    prox = torch.log(torch.tensor([0.4, 0.4, 0.4]))
    old = prox - torch.log(torch.tensor([0.5, 2.0, 8.0]))
    adv = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    rs = dict(level="token", action="mask", metric="ratio", upper=5.0)
    loss, st = F.ppo_actor_loss_fn(prox.clone(), prox, old, adv, 0.2, mask, rejection_sampling=rs)
    assert torch.allclose(st["behave_imp_weight"], torch.tensor([0.5, 2.0, 0.0]))
    assert st["behave_mask"].tolist() == [True, True, False]
    assert st["filtered_fraction"].item() == pytest.approx(1 / 3)
    # denominator keeps the rejected token: (-0.5 - 2 + 0) / 3
    assert loss.item() == pytest.approx(-2.5 / 3, rel=1e-5)
    # no upper bound to reach: weighted, nothing dropped
    inf = dict(rs, upper=float("inf"))
    loss_nocap, _ = F.ppo_actor_loss_fn(
        prox.clone(), prox, old, adv, 0.2, mask, rejection_sampling=inf
    )
    assert loss_nocap.item() == pytest.approx(-10.5 / 3, rel=1e-5)
    # clamp: the weight 8 becomes 5 and the token stays
    clamp = dict(rs, action="clamp")
    loss_clamp, st3 = F.ppo_actor_loss_fn(
        prox.clone(), prox, old, adv, 0.2, mask, rejection_sampling=clamp
    )
    assert loss_clamp.item() == pytest.approx(-7.5 / 3, rel=1e-5)
    assert st3["rs_affected"].tolist() == [False, False, True]
    # None (AReaL): no behaviour weight at all, nothing filtered
    loss_none, st4 = F.ppo_actor_loss_fn(prox.clone(), prox, old, adv, 0.2, mask)
    assert loss_none.item() == pytest.approx(-1.0, rel=1e-5)
    assert "behave_imp_weight" not in st4


# ----------------------------------------------------------------- rejection sampling
# Two sequences, padded [2, 3]: r = pi_prox / pi_behave = [0.5, 2, 8] and [1, 1.5, pad].
_R = torch.tensor([[0.5, 2.0, 8.0], [1.0, 1.5, 1.0]])
_MASK = torch.tensor([[True, True, True], [True, True, False]])
_LN2 = math.log(2.0)
_K2 = [[0.5 * _LN2**2, 0.5 * _LN2**2, 0.5 * (3 * _LN2) ** 2], [0.0, 0.5 * math.log(1.5) ** 2]]
_K3 = [[2 - 1 - _LN2, 0.5 - 1 + _LN2, 0.125 - 1 + 3 * _LN2], [0.0, 1 / 1.5 - 1 + math.log(1.5)]]


def _rs_inputs():
    old = torch.log(torch.full((2, 3), 0.3))
    prox = old + torch.log(_R)
    return prox, old, _MASK.clone()


def test_rejection_sampling_kl_metrics_match_hand_values():
    # hand values of the metrics used below (k3 = 1/r - 1 + log r, as AReaL's estimator)
    assert _K3[0] == pytest.approx([0.3069, 0.1931, 1.2044], abs=1e-4)
    assert _K3[1][1] == pytest.approx(0.0721, abs=1e-4)
    assert _K2[0][2] == pytest.approx(2.1620, abs=1e-4)
    prox, old, _ = _rs_inputs()
    k3 = F.kl_estimator(prox, old, "k3")
    assert k3[0].tolist() == pytest.approx(_K3[0], abs=1e-5)


_SQRT15 = math.sqrt(1.5)
# (config, keep_mask, weights, affected) for every metric x action x level
_RS_CASES = {
    "token-ratio-mask": (
        dict(level="token", action="mask", metric="ratio", upper=5.0),
        [[1, 1, 0], [1, 1, 0]],
        [[0.5, 2.0, 0.0], [1.0, 1.5, 0.0]],
        [[0, 0, 1], [0, 0, 0]],
    ),
    "token-ratio-mask-lower": (
        dict(level="token", action="mask", metric="ratio", upper=5.0, lower=0.6),
        [[0, 1, 0], [1, 1, 0]],
        [[0.0, 2.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 0, 1], [0, 0, 0]],
    ),
    "token-ratio-clamp": (
        dict(level="token", action="clamp", metric="ratio", upper=5.0, lower=0.6),
        [[1, 1, 1], [1, 1, 0]],
        [[0.6, 2.0, 5.0], [1.0, 1.5, 0.0]],
        [[1, 0, 1], [0, 0, 0]],
    ),
    "token-k1-mask": (  # log r = [-0.69, 0.69, 2.08], [0, 0.41]
        dict(level="token", action="mask", metric="kl_k1", upper=1.0, lower=-0.5),
        [[0, 1, 0], [1, 1, 0]],
        [[0.0, 2.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 0, 1], [0, 0, 0]],
    ),
    "token-k2-mask": (  # k2 = [0.24, 0.24, 2.16], [0, 0.08]
        dict(level="token", action="mask", metric="kl_k2", upper=0.2),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "token-k3-mask": (  # k3 = [0.31, 0.19, 1.20], [0, 0.07]
        dict(level="token", action="mask", metric="kl_k3", upper=0.25),
        [[0, 1, 0], [1, 1, 0]],
        [[0.0, 2.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 0, 1], [0, 0, 0]],
    ),
    # sequence level, ratio: geometric means 2 and sqrt(1.5) are the weights
    "seq-ratio-mean-mask": (
        dict(level="sequence", action="mask", metric="ratio", agg="mean", upper=1.5),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [_SQRT15, _SQRT15, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-ratio-sum-mask": (  # products 8 and 1.5
        dict(level="sequence", action="mask", metric="ratio", agg="sum", upper=5.0),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [_SQRT15, _SQRT15, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-ratio-sum-mask-both": (
        dict(level="sequence", action="mask", metric="ratio", agg="sum", upper=1.4),
        [[0, 0, 0], [0, 0, 0]],
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        [[1, 1, 1], [1, 1, 0]],
    ),
    "seq-ratio-max-mask": (  # largest ratios 8 and 1.5
        dict(level="sequence", action="mask", metric="ratio", agg="max", upper=5.0),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [_SQRT15, _SQRT15, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-ratio-mean-clamp": (  # geometric mean 2 clamped to 1.5 on every token
        dict(level="sequence", action="clamp", metric="ratio", agg="mean", upper=1.5),
        [[1, 1, 1], [1, 1, 0]],
        [[1.5, 1.5, 1.5], [_SQRT15, _SQRT15, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-ratio-max-clamp": (  # out of bounds by its max (8), but its weight 2 is in [0, 5]
        dict(level="sequence", action="clamp", metric="ratio", agg="max", upper=5.0),
        [[1, 1, 1], [1, 1, 0]],
        [[2.0, 2.0, 2.0], [_SQRT15, _SQRT15, 0.0]],
        [[0, 0, 0], [0, 0, 0]],
    ),
    "seq-k1-max-mask": (  # max log r: 2.08 and 0.41; KL metrics keep per-token weights
        dict(level="sequence", action="mask", metric="kl_k1", agg="max", upper=0.5),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-k2-sum-mask": (  # sums 2.64 and 0.08
        dict(level="sequence", action="mask", metric="kl_k2", agg="sum", upper=1.0),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-k3-mean-mask": (  # means 0.568 and 0.036
        dict(level="sequence", action="mask", metric="kl_k3", agg="mean", upper=0.5),
        [[0, 0, 0], [1, 1, 0]],
        [[0.0, 0.0, 0.0], [1.0, 1.5, 0.0]],
        [[1, 1, 1], [0, 0, 0]],
    ),
    "seq-k3-mean-mask-lower": (  # lower bound 0.05 rejects the second (0.036)
        dict(level="sequence", action="mask", metric="kl_k3", agg="mean", upper=0.6, lower=0.05),
        [[1, 1, 1], [0, 0, 0]],
        [[0.5, 2.0, 8.0], [0.0, 0.0, 0.0]],
        [[0, 0, 0], [1, 1, 0]],
    ),
}


@pytest.mark.parametrize("case", sorted(_RS_CASES))
def test_rejection_sampling_each_metric_action_level_matches_hand_values(case):
    cfg, keep, weight, affected = _RS_CASES[case]
    prox, old, mask = _rs_inputs()
    res = F.apply_rejection_sampling(prox, old, mask, cfg)
    assert res.keep_mask.int().tolist() == keep
    torch.testing.assert_close(res.behave_imp_weight, torch.tensor(weight), atol=1e-5, rtol=0)
    assert res.affected.int().tolist() == affected
    n_aff = sum(map(sum, affected))
    assert res.filtered_fraction.item() == pytest.approx(n_aff / 5)
    # packed 1-D layout (cu_seqlens) gives the same decisions and weights
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    packed = F.apply_rejection_sampling(prox[mask], old[mask], mask[mask], cfg, cu_seqlens=cu)
    assert packed.keep_mask.tolist() == res.keep_mask[mask].tolist()
    torch.testing.assert_close(packed.behave_imp_weight, res.behave_imp_weight[mask])
    assert packed.filtered_fraction.item() == pytest.approx(n_aff / 5)


def test_rejection_sampling_in_loss_rejected_leave_numerator_and_gspo_ratio():
    # GSPO sequence ratio is the geometric mean over the KEPT tokens only
    prox, old, mask = _rs_inputs()
    logp = prox + torch.tensor([[0.1, 0.2, 3.0], [0.0, 0.0, 0.0]])
    adv = torch.ones(2, 3)
    cfg = dict(level="token", action="mask", metric="ratio", upper=5.0)
    _, st = F.ppo_actor_loss_fn(
        logp,
        prox,
        old,
        adv,
        10.0,
        mask,
        rejection_sampling=cfg,
        importance_sampling_level="sequence",
    )
    assert st["importance_weight"][0, 0].item() == pytest.approx(math.exp(0.15), rel=1e-5)
    assert st["importance_weight"][0, 2].item() == 0.0


def test_rejection_sampling_bad_config_raises():
    prox, old, mask = _rs_inputs()
    with pytest.raises(ValueError, match="metric='ratio'"):
        F.apply_rejection_sampling(prox, old, mask, dict(action="clamp", metric="kl_k3"))
    with pytest.raises(ValueError, match="allowed"):
        F.apply_rejection_sampling(prox, old, mask, dict(metric="kl_k4"))
    with pytest.raises(ValueError, match="cu_seqlens"):
        F.apply_rejection_sampling(prox[mask], old[mask], mask[mask], dict(level="sequence"))


def test_rejection_sampling_accepts_config_dataclass():
    from areal.api.cli_args import RejectionSamplingConfig

    prox, old, mask = _rs_inputs()
    cfg = RejectionSamplingConfig(level="token", action="clamp", metric="ratio", upper=5.0)
    res = F.apply_rejection_sampling(prox, old, mask, cfg)
    assert res.behave_imp_weight[0].tolist() == pytest.approx([0.5, 2.0, 5.0])


# ------------------------------------------------------- loglinear proximal logprobs
def test_loglinear_prox_logp_alpha_from_versions_hand_values():
    old = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    cur = torch.tensor([[-2.0, -1.0, -1.0, -2.0]])
    versions = torch.tensor([[-1, 5, 4, 2]])  # prompt, fresh, 1 stale, 3 stale
    # first minibatch: weights are still the proximal ones -> exact = current logprobs
    p0 = F.loglinear_prox_logp(old, cur, versions, proximal_version=5, update_progress=0.0)
    assert p0.tolist() == [[-1.0, -2.0, -1.0, -2.0]]
    # halfway: alpha = (5 - v) / (5.5 - v): 1-stale 1/1.5, 3-stale 3/3.5; fresh stays old
    p = F.loglinear_prox_logp(old, cur, versions, proximal_version=5, update_progress=0.5)
    expect = [-1.0, -2.0, -3.0 + (2 / 3) * 2.0, -4.0 + (3 / 3.5) * 2.0]
    assert p[0].tolist() == pytest.approx(expect, abs=1e-6)


def test_ppo_actor_loss_masked_tokens_ignored():
    logp = torch.tensor([0.0, 50.0])
    loss, st = F.ppo_actor_loss_fn(
        logp,
        torch.zeros(2),
        torch.zeros(2),
        torch.tensor([2.0, 7.0]),
        0.2,
        torch.tensor([True, False]),
    )
    assert loss.item() == pytest.approx(-2.0)
    assert st["importance_weight"][1] == 0


def _loop_seq_loss(logp, prox, adv, mask, cu, eps):
    losses = []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        m = mask[s:e]
        lr = (logp[s:e] - prox[s:e])[m].mean()
        a = adv[s:e][m].mean()
        r = math.exp(lr.item())
        losses += [max(-a.item() * r, -a.item() * min(max(r, 1 - eps), 1 + eps))] * int(m.sum())
    return sum(losses) / len(losses)


def test_ppo_actor_loss_gspo_sequence_ratio_matches_loop_packed_and_padded():
    cu = [0, 3, 7, 9]
    n = cu[-1]
    logp = torch.randn(n) * 0.3
    prox = torch.randn(n) * 0.3
    adv = torch.randn(n)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    loss, st = F.ppo_actor_loss_fn(
        logp, prox, prox, adv, 0.2, mask, importance_sampling_level="sequence", cu_seqlens=cu_t
    )
    assert loss.item() == pytest.approx(_loop_seq_loss(logp, prox, adv, mask, cu, 0.2), rel=1e-5)
    # every token of a sequence carries the same ratio exp(mean log-ratio)
    seq0 = math.exp(((logp - prox)[[0, 1]]).mean().item())
    assert st["importance_weight"][0].item() == pytest.approx(seq0, rel=1e-5)
    assert st["importance_weight"][1].item() == pytest.approx(seq0, rel=1e-5)
    # padded [B, T] version gives the same loss
    T = 4

    def pad(x):
        return torch.stack(
            [
                torch.nn.functional.pad(x[cu[i] : cu[i + 1]], (0, T - (cu[i + 1] - cu[i])))
                for i in range(3)
            ]
        )

    loss2, _ = F.ppo_actor_loss_fn(
        pad(logp),
        pad(prox),
        pad(prox),
        pad(adv),
        0.2,
        pad(mask),
        importance_sampling_level="sequence",
    )
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-5)


def test_ppo_actor_loss_bad_is_level_raises():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        F.ppo_actor_loss_fn(
            torch.zeros(1),
            torch.zeros(1),
            torch.zeros(1),
            torch.ones(1),
            0.2,
            torch.ones(1, dtype=torch.bool),
            importance_sampling_level="seq",
        )


# ------------------------------------------------------------------ aggregation
def test_aggregate_token_vs_sequence_vs_constant_norm():
    tl = torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    cu = torch.tensor([0, 3, 5])
    assert F.aggregate_token_loss(tl, mask, "token-mean").item() == pytest.approx(16 / 4)
    # seq means: 2 and 10 -> 6
    assert F.aggregate_token_loss(tl, mask, "seq-mean-token-mean", cu).item() == pytest.approx(6.0)
    # seq sums 6 and 10, / constant 8, mean over 2 seqs -> 1.0
    assert F.aggregate_token_loss(
        tl, mask, "seq-mean-token-sum-norm", cu, 8.0
    ).item() == pytest.approx(1.0)
    padded = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    pmask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert F.aggregate_token_loss(padded, pmask, "seq-mean-token-mean").item() == pytest.approx(6.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        F.aggregate_token_loss(tl, mask, "bogus", cu)


# ------------------------------------------------------------------ SAPO
def test_sapo_gate_values_and_gradient_at_ratio_one():
    r = torch.tensor([1.0, 1.5, 0.5])
    adv = torch.tensor([1.0, 1.0, -2.0])
    logp = torch.log(r).requires_grad_()
    old = torch.zeros(3)
    loss, st = F.sapo_loss_fn(
        logp, old, adv, tau_pos=1.0, tau_neg=2.0, loss_mask=torch.ones(3, dtype=torch.bool)
    )

    def sig(x):
        return 1 / (1 + math.exp(-x))

    g = [4 * sig(0.0), 4 * sig(0.5), 2 * sig(2 * -0.5)]
    expected = [-g[0] * 1, -g[1] * 1, -g[2] * -2]
    assert torch.allclose(st["loss"], torch.tensor(expected), atol=1e-6)
    assert loss.item() == pytest.approx(sum(expected) / 3, rel=1e-6)
    loss.backward()
    # d/dlogp of -(4/tau) sig(tau (r-1)) A = -4 s (1-s) r A ; at r=1: -A (like PPO)
    assert logp.grad[0].item() == pytest.approx(-1.0 / 3, rel=1e-5)
    s1 = sig(0.5)
    assert logp.grad[1].item() == pytest.approx(-4 * s1 * (1 - s1) * 1.5 / 3, rel=1e-5)


def test_sapo_invalid_tau_raises():
    with pytest.raises(ValueError, match="tau"):
        F.sapo_loss_fn(
            torch.zeros(1), torch.zeros(1), torch.ones(1), 0.0, 1.0, torch.ones(1, dtype=torch.bool)
        )


# ------------------------------------------------------------------ M2PO
def _m2po_loop(d2, mask, thr):
    vals = sorted([(d2[i].item(), i) for i in range(len(d2)) if mask[i]], reverse=True)
    keep = [i for _, i in vals]
    while keep and sum(d2[i].item() for i in keep) / len(keep) > thr:
        keep.pop(0)
    out = torch.zeros_like(mask)
    out[keep] = True
    return out


def test_m2po_mask_hand_example_drops_largest_until_under_threshold():
    old = torch.zeros(5)
    prox = torch.tensor([0.1, 1.0, 0.1, 0.5, 0.0])  # d2 = .01, 1, .01, .25, 0
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    # all 4: mean 0.3175 > 0.1; drop 1.0 -> (0.27)/3 = 0.09 <= 0.1
    out = F.m2po_loss_mask(old, prox, mask, 0.1)
    assert out.tolist() == [True, False, True, True, False]
    out2 = F.m2po_loss_mask(old, prox, mask, 0.05)  # also drop 0.25 -> 0.01
    assert out2.tolist() == [True, False, True, False, False]
    assert F.m2po_loss_mask(old, prox, mask, 1.0).tolist() == mask.tolist()


def test_m2po_mask_random_matches_loop_reference():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        old = torch.randn(3, 7, generator=g) * 0.3
        prox = torch.randn(3, 7, generator=g) * 0.3
        mask = torch.rand(3, 7, generator=g) > 0.3
        thr = float(torch.rand(1, generator=g)) * 0.3 + 0.01
        out = F.m2po_loss_mask(old, prox, mask, thr)
        ref = _m2po_loop((prox - old).square().reshape(-1), mask.reshape(-1), thr).view_as(mask)
        assert torch.equal(out, ref)


# ------------------------------------------------------------------ GAE
def _gae_loop(r, v, mask, gamma, lam):
    B, T = r.shape
    adv = torch.zeros(B, T)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        last = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            nv = v[b, idx[j + 1]].item() if j + 1 < len(idx) else 0.0
            delta = r[b, t].item() + gamma * nv - v[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_gae_matches_loop_with_gaps_in_mask():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(3, 8, generator=g)
    v = torch.randn(3, 8, generator=g)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]]
    )
    adv, ret = F.gae(r, v, mask, gamma=0.9, lam=0.8)
    ref = _gae_loop(r, v, mask.bool(), 0.9, 0.8)
    assert torch.allclose(adv, ref, atol=1e-5)
    assert torch.allclose(ret, torch.where(mask.bool(), ref + v, 0.0), atol=1e-5)


def test_compute_returns_discounted_hand_values():
    r = torch.tensor([[0.0, 0.0, 1.0, 2.0]])
    mask = torch.tensor([[0, 1, 1, 1]])
    ret = F.compute_returns(r, mask, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[0.0, 0.5 * 1 + 0.25 * 2, 1 + 0.5 * 2, 2.0]]))


# ------------------------------------------------------------------ normalisation
def test_group_normalization_group_mean_and_unbiased_std():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    out = F.group_normalization(x, mean_level="group", std_level="group", group_size=3, eps=0.0)
    for grp, o in ((x[:3], out[:3]), (x[3:], out[3:])):
        ref = (grp - grp.mean()) / grp.std(unbiased=True)
        assert torch.allclose(o, ref, atol=1e-6)
    biased = F.group_normalization(x, None, "group", "group", 3, std_unbiased=False, eps=0.0)
    assert torch.allclose(biased[:3], (x[:3] - 2.0) / x[:3].std(unbiased=False), atol=1e-6)


def test_group_normalization_leave_one_out_mean_no_std():
    x = torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0, 8.0])
    out = F.group_normalization(
        x, mean_level="group", std_level=None, group_size=3, mean_leave1out=True
    )
    ref = torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 0 - 6.0, 4 - 4.0, 8 - 2.0])
    assert torch.allclose(out, ref)


def test_group_normalization_group_mean_batch_std_mixed_levels():
    x = torch.tensor([1.0, 3.0, 10.0, 30.0])
    out = F.group_normalization(x, mean_level="group", std_level="batch", group_size=2, eps=0.0)
    centred = torch.tensor([-1.0, 1.0, -10.0, 10.0])
    assert torch.allclose(out, centred / x.std(unbiased=True), atol=1e-6)


def test_masked_normalization_batch_level_over_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = F.masked_normalization(x, mask, eps=0.0)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ref = (vals - vals.mean()) / vals.std(unbiased=False)
    assert torch.allclose(out[mask.bool()], ref, atol=1e-6)
    assert (out[~mask.bool()] == 0).all()


def test_group_normalization_bad_level_or_group_raises():
    with pytest.raises(ValueError, match="mean_level"):
        F.group_normalization(torch.zeros(4), mean_level="global")
    with pytest.raises(ValueError, match="group_size"):
        F.group_normalization(torch.zeros(5), mean_level="group", group_size=2)


# ------------------------------------------------------------------ critic / rewards / filter
def test_ppo_critic_loss_value_clipping_hand_values():
    v = torch.tensor([1.0, 0.0, 0.55], requires_grad=True)
    old = torch.tensor([0.5, 0.5, 0.5])
    tgt = torch.tensor([0.0, 1.0, 0.6])
    loss, st = F.ppo_critic_loss_fn(v, old, tgt, 0.2, torch.ones(3, dtype=torch.bool))
    # tok0: orig 0.5, clipped V=0.7 -> 0.245 -> max 0.5; tok1: orig 0.5, clipped 0.3 -> 0.245 -> 0.5
    # tok2: orig 0.5*0.05^2, clipped = same value (within eps) -> equal
    expected = torch.tensor([0.5, 0.5, 0.5 * 0.05**2])
    assert torch.allclose(st["loss"], expected, atol=1e-6)
    assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-5)
    v2 = torch.tensor([2.0], requires_grad=True)
    l2, st2 = F.ppo_critic_loss_fn(
        v2, torch.tensor([0.0]), torch.tensor([3.0]), 0.2, torch.ones(1, dtype=torch.bool)
    )
    # clipped V=0.2 -> 0.5*2.8^2=3.92 > 0.5*1 -> clipped loss is used, zero grad
    assert l2.item() == pytest.approx(3.92, rel=1e-5) and st2["clip_mask"].item()
    l2.backward()
    assert v2.grad.item() == 0.0


def test_reward_overlong_penalty_dapo_piecewise():
    rewards = torch.zeros(4)
    lengths = torch.tensor([5, 8, 9, 12])
    out = F.reward_overlong_penalty(
        rewards, lengths, overlong_tokens=4, overlong_penalty_factor=1.0, max_response_length=10
    )
    # expected len 6: 5 -> 0 ; 8 -> -2/4 ; 9 -> -3/4 ; 12 -> -1 (clamped)
    assert torch.allclose(out, torch.tensor([0.0, -0.5, -0.75, -1.0]))


def test_dynamic_sampling_accept_and_group_mask():
    assert F.dynamic_sampling_accept({"rewards": torch.tensor([1.0, 0.0, 1.0])})
    assert not F.dynamic_sampling_accept({"rewards": torch.tensor([1.0, 1.0, 1.0])})
    keep = F.uniform_reward_group_mask(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert keep.tolist() == [False, False, True, True, False, False]


# ---------------------------------------------- groups by id (agent episodes, one row per call)
def _episode_norm_reference(rows, norm_eps=1e-5, leave1out=False):
    """Per-row expected values from (group, episode, reward) rows with plain Python:
    statistics over the episodes of each group (first row = the episode's value)."""
    first: dict = {}
    for g, e, r in rows:
        first.setdefault((g, e), r)
    out = []
    for g, e, r in rows:
        vals = [v for (gg, _), v in first.items() if gg == g]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        if leave1out:
            others = [v for (gg, ee), v in first.items() if gg == g and ee != e]
            out.append((r - sum(others) / len(others)) / (std + norm_eps))
        else:
            out.append((r - mean) / (std + norm_eps))
    return torch.tensor(out)


def test_group_normalization_ids_of_fixed_layout_identical_to_group_size_path():
    gen = torch.Generator().manual_seed(3)
    r = torch.randint(0, 3, (12,), generator=gen).float()
    adv = torch.randn(12, 5, generator=gen)
    mask = torch.rand(12, 5, generator=gen) > 0.3
    gids, eids = torch.arange(3).repeat_interleave(4) + 40, torch.arange(12) + 7
    for kw in (
        dict(mean_level="group", std_level="group"),
        dict(mean_level="group", std_level=None, mean_leave1out=True),
        dict(mean_level="batch", std_level="group", std_unbiased=False),
    ):
        fixed = F.group_normalization(r, None, group_size=4, **kw)
        by_id = F.group_normalization(r, None, group_size=1, group_ids=gids, episode_ids=eids, **kw)
        assert torch.equal(fixed, by_id)
        fixed = F.group_normalization(adv, mask, group_size=4, **kw)
        assert torch.equal(fixed, F.group_normalization(adv, mask, group_ids=gids, **kw))


def test_group_normalization_variable_episodes_statistics_over_episodes_not_rows():
    # group 5: episodes a (1 call, r=1), b (3 calls, r=0), c (2 calls, r=1), d (1 call, r=0);
    # group 2: episodes of 2, 1, 1, 3 calls with rewards .25, 1, 0, .5; rows interleaved
    rows = [(5, 0, 1.0), (2, 10, 0.25), (5, 1, 0.0), (5, 1, 0.0), (2, 10, 0.25), (5, 1, 0.0)]
    rows += [(2, 11, 1.0), (5, 2, 1.0), (5, 2, 1.0), (2, 12, 0.0), (5, 3, 0.0)]
    rows += [(2, 13, 0.5), (2, 13, 0.5), (2, 13, 0.5)]
    g, e, r = (torch.tensor(c) for c in zip(*rows))
    out = F.group_normalization(r, None, "group", "group", group_ids=g, episode_ids=e)
    assert torch.allclose(out, _episode_norm_reference(rows).to(out.dtype), atol=1e-6)
    # rows of one episode get the same value; group 5 is +-0.866 although it has 4 rows of
    # reward 0 and 3 of reward 1 (row statistics would give other numbers)
    assert out[[2, 3, 5]].unique().numel() == 1 and out[[7, 8]].unique().numel() == 1
    assert abs(float(out[0]) - 0.5 / math.sqrt(1 / 3)) < 1e-4
    loo = F.group_normalization(
        r, None, "group", "group", mean_leave1out=True, group_ids=g, episode_ids=e
    )
    assert torch.allclose(loo, _episode_norm_reference(rows, leave1out=True).float(), atol=1e-6)
    # batch level counts every episode once as well (8 episodes)
    batch = F.group_normalization(r, None, "batch", None, group_ids=g, episode_ids=e)
    ep_vals = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.25, 1.0, 0.0, 0.5])
    assert torch.allclose(batch, r - ep_vals.mean(), atol=1e-6)


def test_group_normalization_discounted_episode_rows_keep_their_own_reward():
    # turn discount 0.5: a 3-call episode with final reward 1 has rows 0.25, 0.5, 1
    rows = [(0, 0, 0.25), (0, 0, 0.5), (0, 0, 1.0), (0, 1, 0.0), (0, 2, 1.0), (0, 3, 0.0)]
    g, e, r = (torch.tensor(c) for c in zip(*rows))
    out = F.group_normalization(r, None, "group", "group", group_ids=g, episode_ids=e)
    assert torch.allclose(out, _episode_norm_reference(rows).float(), atol=1e-6)


def test_group_normalization_bad_ids_raise():
    r = torch.tensor([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="different group_ids"):
        F.group_normalization(
            r, None, "group", "group", group_ids=torch.tensor([0, 1, 1]),
            episode_ids=torch.tensor([4, 4, 5]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        F.group_normalization(r, None, "group", "group", group_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="per-sequence"):
        F.group_normalization(
            torch.ones(3, 2), None, "group", "group", group_ids=torch.tensor([0, 0, 0]),
            episode_ids=torch.tensor([1, 1, 2]),
        )  # fmt: skip


def test_dynamic_sampling_by_episode_compares_episode_returns():
    # uniform group: every episode made 3 calls and earned 1, discounted rows .25 .5 1
    uniform = {
        "rewards": torch.tensor([0.25, 0.5, 1.0] * 2),
        "episode_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
    }
    assert F.dynamic_sampling_accept({"rewards": uniform["rewards"]})  # rows: not uniform
    assert not F.dynamic_sampling_accept(uniform)
    mixed = {"rewards": torch.tensor([1.0, 1.0, 0.0]), "episode_ids": torch.tensor([3, 3, 4])}
    assert F.dynamic_sampling_accept(mixed)
    one = {"rewards": torch.tensor([0.0, 1.0]), "episode_ids": torch.tensor([2, 2])}
    assert F.dynamic_sampling_accept(one)  # one episode: nothing to compare, kept
    # the batch mask: groups 8 (uniform per episode) and 3 (mixed), rows interleaved
    rewards = torch.tensor([0.5, 1.0, 0.0, 0.5, 1.0, 1.0, 1.0])
    gids = torch.tensor([8, 8, 3, 8, 8, 3, 3])
    eids = torch.tensor([0, 0, 1, 2, 2, 3, 3])
    keep = F.uniform_reward_group_mask(rewards, group_ids=gids, episode_ids=eids)
    assert keep.tolist() == [False, False, True, False, False, True, True]
    assert F.uniform_reward_group_mask(rewards, group_ids=gids).tolist() == [True] * 7
