"""AReaL 2.0's loss variants: CISPO, KPop's ``binary_kl`` rejection, ``reuse_train_logp``.

Formulas against hand computations, config validation, and the actor's update with each
(the tiny bigram engine of ``test_ppo_actor``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_ppo_actor import TinyEngine, _update, _versioned_setup, cfg, make_batch

from areal.api.cli_args import NormConfig, PPOActorConfig, RejectionSamplingConfig
from areal.trainer.ppo.actor import PPOActor
from areal.utils import functional as F
from areal.utils import stats_tracker


# ----------------------------------------------------------------------------- CISPO
def test_cispo_loss_and_gradient_match_hand_values_clipped_tokens_keep_gradient():
    # ratios 1.5 (above 1 + 0.3), 0.5 (below 1 - 0.2), 1.1 (inside); advantages 2, -1, 0.5
    prox = torch.tensor([-1.0, -2.0, -0.5])
    logp = (prox + torch.log(torch.tensor([1.5, 0.5, 1.1]))).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, 0.5])
    mask = torch.ones(3, dtype=torch.bool)
    loss, stat = F.cispo_loss_fn(logp, prox, prox, adv, 0.2, 0.3, mask)
    w = [1.3, 0.8, 1.1]  # clip(r, 0.8, 1.3), no gradient through it
    lp = logp.detach().tolist()
    expect = -(w[0] * 2.0 * lp[0] + w[1] * -1.0 * lp[1] + w[2] * 0.5 * lp[2]) / 3
    assert float(loss.detach()) == pytest.approx(expect, rel=1e-6)
    loss.backward()
    # d loss / d logp_t = -w_t * A_t / 3: the clipped tokens' gradients are NOT zero
    expect_grad = torch.tensor([-1.3 * 2.0, 0.8 * 1.0, -1.1 * 0.5]) / 3
    torch.testing.assert_close(logp.grad, expect_grad, rtol=1e-6, atol=1e-7)
    assert stat["clip_mask"].tolist() == [True, True, False]
    torch.testing.assert_close(stat["importance_weight"], torch.tensor([1.5, 0.5, 1.1]))
    # the PPO surrogate zeroes the first token's gradient (A > 0, r above the band)
    logp2 = logp.detach().clone().requires_grad_(True)
    ppo, _ = F.ppo_actor_loss_fn(logp2, prox, prox, adv, 0.2, mask, eps_clip_higher=0.3)
    ppo.backward()
    assert float(logp2.grad[0]) == 0.0


def test_cispo_rejection_sampling_masks_and_weights_by_behaviour_ratio():
    prox = torch.tensor([-1.0, -1.0, -1.0])
    old = prox - torch.log(torch.tensor([1.2, 4.0, 0.9]))  # pi_prox / pi_behave
    logp = prox.clone().requires_grad_(True)  # ratio 1: weight 1
    adv = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    rs = RejectionSamplingConfig(metric="ratio", upper=2.0)
    loss, stat = F.cispo_loss_fn(logp, prox, old, adv, 1.0, 4.0, mask, rejection_sampling=rs)
    # token 2 rejected (4 > 2) but stays in the denominator; others weighted 1.2 and 0.9
    assert float(loss.detach()) == pytest.approx(-(1.2 * -1.0 + 0.9 * -1.0) / 3, rel=1e-6)
    assert stat["behave_mask"].tolist() == [True, False, True]
    assert float(stat["filtered_fraction"]) == pytest.approx(1 / 3)


def test_cispo_packed_loss_agg_mode_sequence_mean():
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    cu = torch.tensor([0, 1, 3])
    adv = torch.ones(3)
    mask = torch.ones(3, dtype=torch.bool)
    loss, _ = F.cispo_loss_fn(
        logp, logp.detach(), logp.detach(), adv, 1.0, 4.0, mask, cu_seqlens=cu,
        loss_agg_mode="seq-mean-token-mean",
    )  # fmt: skip
    # sequences [1.0] and [2.0, 3.0] (negated logprobs): mean(1.0, 2.5)
    assert float(loss.detach()) == pytest.approx((1.0 + 2.5) / 2)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(eps_clip_higher=None), "eps_clip_higher"),
        (dict(eps_clip_higher=0.0), "eps_clip_higher"),
        (dict(eps_clip_higher=4.0, use_sapo_loss=True), "mutually exclusive"),
        (dict(eps_clip_higher=4.0, importance_sampling_level="sequence"), "token"),
    ],
)
def test_cispo_config_bad_combinations_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        PPOActorConfig(use_cispo_loss=True, **kw)
    with pytest.raises(ValueError, match="eps_clip_higher"):
        F.cispo_loss_fn(
            torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.ones(1), 0.2, None, torch.ones(1)
        )


def test_ppo_update_cispo_equals_one_sgd_step_on_the_direct_loss():
    torch.manual_seed(0)
    data = make_batch(bs=6)
    eng = TinyEngine(mb_seqs=2)
    c = cfg(use_cispo_loss=True, eps_clip=0.2, eps_clip_higher=0.1)
    actor = PPOActor(c, eng)
    data["prox_logp"] = actor.compute_logp(data) + 0.3 * data["loss_mask"]  # ratios != 1
    actor.compute_advantages(data)
    model = copy.deepcopy(eng.model)
    logp, _ = model.aligned(data["input_ids"], data["attention_mask"])
    loss, _ = F.cispo_loss_fn(
        logp, data["prox_logp"], data["old_logp"], data["advantages"], 0.2, 0.1,
        data["loss_mask"],
    )  # fmt: skip
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    actor.ppo_update(data)
    out = stats_tracker.export()
    assert out["ppo_actor/update/clip_ratio/avg"] > 0  # ratios exp(-0.3) < 0.8: clipped
    for p, q in zip(eng.model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------- KPop binary KL
def _bkl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_binary_kl_matches_hand_values_both_directions():
    lp, lq = torch.log(torch.tensor([0.5, 0.9])), torch.log(torch.tensor([0.25, 0.9]))
    out = F.binary_kl(lp, lq)
    assert float(out[0]) == pytest.approx(_bkl(0.5, 0.25), rel=1e-5)  # 0.1438
    assert float(out[1]) == pytest.approx(0.0, abs=1e-7)
    assert float(F.binary_kl(lq, lp)[0]) == pytest.approx(_bkl(0.25, 0.5), rel=1e-5)  # 0.1308


def test_rejection_sampling_binary_kl_masks_tokens_over_the_larger_direction():
    # token 0: p_prox 0.5 vs p_behave 0.25: max(0.1438, 0.1308) = 0.1438
    # token 1: 0.9 vs 0.6: KL(0.9||0.6) = 0.2263, KL(0.6||0.9) = 0.3112 -> 0.3112
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.6, 0.3]]))
    mask = torch.tensor([[True, True, True]])
    m1 = max(_bkl(0.9, 0.6), _bkl(0.6, 0.9))
    assert m1 == pytest.approx(0.3112, abs=1e-4)
    for upper, kept in [(0.14, [False, False, True]), (0.2, [True, False, True]),
                        (0.32, [True, True, True])]:  # fmt: skip
        rs = RejectionSamplingConfig(metric="binary_kl", upper=upper)
        res = F.apply_rejection_sampling(prox, old, mask, rs)
        assert res.keep_mask[0].tolist() == kept, upper
        torch.testing.assert_close(
            res.behave_imp_weight[0],
            torch.where(torch.tensor(kept), torch.exp(prox - old)[0], 0.0),
        )
    # sequence level, mean: (0.1438 + 0.3112 + 0) / 3 = 0.1517
    rs = RejectionSamplingConfig(metric="binary_kl", level="sequence", agg="mean", upper=0.152)
    assert F.apply_rejection_sampling(prox, old, mask, rs).keep_mask.all()
    rs = RejectionSamplingConfig(metric="binary_kl", level="sequence", agg="mean", upper=0.151)
    assert not F.apply_rejection_sampling(prox, old, mask, rs).keep_mask.any()


def test_binary_kl_config_validation():
    with pytest.raises(ValueError, match="upper"):
        RejectionSamplingConfig(metric="binary_kl", upper=0.0)
    with pytest.raises(ValueError, match="clamp"):
        RejectionSamplingConfig(metric="binary_kl", action="clamp", upper=2.0)
    assert RejectionSamplingConfig(metric="binary_kl", upper=2.0).metric == "binary_kl"


# ------------------------------------------------------------------- reuse_train_logp
def test_reuse_train_logp_forces_one_minibatch_and_skips_prox_forward(caplog):
    c = PPOActorConfig(
        use_decoupled_loss=True, prox_logp_method="reuse_train_logp", ppo_n_minibatches=4
    )
    assert c.ppo_n_minibatches == 1
    assert not c.should_compute_prox_logp()
    assert PPOActorConfig(use_decoupled_loss=True).should_compute_prox_logp()


def test_reuse_train_logp_update_equals_recompute_without_prox_forward():
    eng, data, exact = _versioned_setup()
    calls = []
    eng_r = copy.deepcopy(eng)
    orig = eng_r.forward_batch
    eng_r.forward_batch = lambda *a, **k: calls.append(1) or orig(*a, **k)
    c = cfg(
        recompute_logprob=True,
        use_decoupled_loss=True,
        prox_logp_method="reuse_train_logp",
        rejection_sampling=RejectionSamplingConfig(action="clamp", upper=1.02),
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
    )
    d = {k: v.clone() for k, v in data.items() if k != "versions"}  # versions not needed
    actor = PPOActor(c, eng_r)
    actor.compute_advantages(d)
    assert "prox_logp" not in d
    d["prox_logp"] = exact + 1.0  # a stale prox_logp in the batch is ignored (as AReaL)
    actor.ppo_update(d)
    out = stats_tracker.export()
    assert calls == []
    assert out["ppo_actor/update/rs_filtered_fraction/avg"] > 0  # clamp acted
    ref, _, _ = _update(eng, data, "recompute", 1, prox=exact)
    for p, q in zip(eng_r.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
