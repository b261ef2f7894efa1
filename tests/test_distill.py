"""On-policy distillation term of the actor loss (AReaL's rl_loss_weight / distill_loss_weight)."""

from __future__ import annotations

import math

import pytest
import torch

from areal.trainer.ppo.actor import distill_loss, grpo_loss_fn
from areal.utils import stats_tracker


def _tokens():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    old = torch.tensor([-1.2, -2.0, -0.4, -3.0])
    teacher = torch.tensor([-0.5, -2.5, -0.1, -9.0])
    mask = torch.tensor([True, True, True, False])
    return logp, old, teacher, mask


def test_distill_joint_loss_adds_weighted_mean_log_ratio():
    logp, old, teacher, mask = _tokens()
    rl = torch.tensor(0.7)
    loss, _ = distill_loss(rl, logp, old, teacher, mask, rl_loss_weight=0.5, distill_loss_weight=2)
    penalty = ((-1.0 + 0.5) + (-2.0 + 2.5) + (-0.5 + 0.1)) / 3
    assert loss.item() == pytest.approx(0.5 * 0.7 + 2 * penalty, abs=1e-6)


def test_distill_pure_loss_is_importance_weighted_reverse_kl_reinforce():
    logp, old, teacher, mask = _tokens()
    lp = logp.clone().requires_grad_(True)
    loss, rkl = distill_loss(torch.tensor(5.0), lp, old, teacher, mask, 0.0, 1.0)
    w = [math.exp(0.2), 1.0, math.exp(-0.1)]
    r = [0.5, -0.5, 0.4]
    expected = -sum(a * b for a, b in zip(w, r, strict=True)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)  # the RL loss (5.0) is dropped
    loss.backward()
    # d/dlogp of -w*r/3 with w = exp(logp - old): -w*r/3 (reward has no gradient)
    for i in range(3):
        assert lp.grad[i].item() == pytest.approx(-w[i] * r[i] / 3, abs=1e-6)
    assert lp.grad[3].item() == 0.0
    assert rkl[:3].tolist() == pytest.approx([-a * b for a, b in zip(w, r, strict=True)])


def test_grpo_loss_with_teacher_logp_pure_distillation_ignores_advantages():
    logp, old, teacher, mask = _tokens()
    base = {
        "loss_mask": mask,
        "old_logp": old,
        "teacher_logp": teacher,
        "rl_loss_weight": torch.tensor([0.0]),
        "distill_loss_weight": torch.tensor([1.0]),
        "cu_seqlens": torch.tensor([0, 4]),
    }
    a = grpo_loss_fn(logp, None, {**base, "advantages": torch.ones(4)}, eps_clip=0.2)
    b = grpo_loss_fn(logp, None, {**base, "advantages": -torch.ones(4)}, eps_clip=0.2)
    expected, _ = distill_loss(torch.tensor(0.0), logp, old, teacher, mask, 0.0, 1.0)
    assert a.item() == pytest.approx(expected.item(), abs=1e-6)
    assert b.item() == pytest.approx(a.item(), abs=1e-6)
    out = stats_tracker.export_all()
    assert "rkl_loss/avg" in out


def test_grpo_loss_without_teacher_is_unchanged():
    logp, old, _, mask = _tokens()
    data = {"loss_mask": mask, "old_logp": old, "advantages": torch.ones(4)}
    with_w = grpo_loss_fn(logp, None, {**data, "rl_loss_weight": torch.tensor([0.0])}, 0.2)
    plain = grpo_loss_fn(logp, None, data, 0.2)
    assert with_w.item() == plain.item()
    stats_tracker.export_all()
