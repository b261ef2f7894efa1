"""DPO (sigmoid, IPO) and reward-model (Bradley-Terry) losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from areal.trainer.dpo.dpo_engine import compute_dpo_loss, dpo_pair_metrics
from areal.trainer.preference import collate_pairs
from areal.trainer.rw.rw_engine import compute_rw_loss, rw_loss_weight
from areal.utils import stats_tracker


def _packed_pair():
    # one pair: chosen has 4 tokens (2 prompt + 2 response), rejected 5 (2 + 3)
    cu = torch.tensor([0, 4, 9])
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1])
    logp = torch.tensor([0.0, -9.0, -0.5, -1.0, 0.0, -9.0, -0.2, -0.3, -1.5])
    ref = torch.tensor([0.0, -8.0, -0.7, -1.1, 0.0, -8.0, -0.4, -0.3, -0.9])
    return {"cu_seqlens": cu, "loss_mask": loss_mask, "ref_logp": ref}, logp


def test_dpo_sigmoid_loss_one_pair_matches_hand_computed():
    data, logp = _packed_pair()
    # policy: chosen -1.5, rejected -2.0; ref: chosen -1.8, rejected -1.6
    h = (-1.5 - -1.8) - (-2.0 - -1.6)  # 0.3 + 0.4 = 0.7
    beta = 0.5
    expected = -math.log(1 / (1 + math.exp(-beta * h)))
    got = compute_dpo_loss(logp, None, data, beta=beta, loss_type="sigmoid")
    assert got.item() == pytest.approx(expected, abs=1e-6)
    stats_tracker.export_all()


def test_dpo_ipo_loss_one_pair_is_length_normalised():
    data, logp = _packed_pair()
    beta = 0.5
    h = 0.3 / 2 - (-0.4) / 3  # per-token log-ratios: chosen 2 tokens, rejected 3
    expected = (h - 1 / (2 * beta)) ** 2
    got = compute_dpo_loss(logp, None, data, beta=beta, loss_type="ipo")
    assert got.item() == pytest.approx(expected, abs=1e-6)
    stats_tracker.export_all()


def test_dpo_loss_gradient_flows_only_through_response_tokens():
    data, logp = _packed_pair()
    logp = logp.clone().requires_grad_(True)
    compute_dpo_loss(logp, None, data, beta=0.1).backward()
    assert torch.all(logp.grad[data["loss_mask"] == 0] == 0)
    assert torch.all(logp.grad[:4][data["loss_mask"][:4] == 1] < 0)  # raise chosen
    assert torch.all(logp.grad[4:][data["loss_mask"][4:] == 1] > 0)  # lower rejected
    stats_tracker.export_all()


def test_dpo_loss_records_reward_stats():
    data, logp = _packed_pair()
    with stats_tracker.scope("dpo"):
        compute_dpo_loss(logp, None, data, beta=0.5)
    out = stats_tracker.export_all()
    assert out["dpo/chosen_reward/avg"] == pytest.approx(0.5 * 0.3, abs=1e-6)
    assert out["dpo/rejected_reward/avg"] == pytest.approx(0.5 * -0.4, abs=1e-6)
    assert out["dpo/reward_margin/avg"] == pytest.approx(0.35, abs=1e-6)
    assert out["dpo/reward_accuracy/avg"] == 1.0
    assert out["dpo/chosen_logp/avg"] == pytest.approx(-1.5, abs=1e-6)


def test_dpo_pair_metrics_policy_equal_to_reference_has_zero_margin():
    rows = torch.tensor([[-1.0, -2.0, -1.0, -2.0, 2, 2], [-3.0, -1.0, -3.0, -1.0, 2, 2]])
    m = dpo_pair_metrics(rows, beta=0.1)
    assert m["loss"] == pytest.approx(math.log(2))
    assert m["reward_accuracy"] == 0.0 and m["reward_margin"] == 0.0
    assert m["preference_accuracy"] == 0.5


def test_dpo_loss_unknown_type_raises():
    data, logp = _packed_pair()
    with pytest.raises(ValueError, match="loss_type"):
        compute_dpo_loss(logp, None, data, beta=0.1, loss_type="hinge")


def test_rw_loss_two_pairs_matches_hand_computed():
    # sequences of lengths 3, 2, 4, 1: scores are the values at the last tokens
    cu = torch.tensor([0, 3, 5, 9, 10])
    values = torch.tensor([9.0, 9.0, 1.5, 9.0, 0.5, 9.0, 9.0, 9.0, -1.0, 2.0])
    data = {"cu_seqlens": cu}
    m1, m2 = 1.5 - 0.5, -1.0 - 2.0
    expected = (math.log1p(math.exp(-m1)) + math.log1p(math.exp(-m2))) / 2
    with stats_tracker.scope("rw"):
        got = compute_rw_loss(values, None, data)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    assert int(rw_loss_weight(data)) == 2
    out = stats_tracker.export_all()
    assert out["rw/accuracy/avg"] == 0.5
    assert out["rw/margin/avg"] == pytest.approx((m1 + m2) / 2)


def test_rw_loss_odd_number_of_sequences_raises():
    with pytest.raises(ValueError, match="even"):
        compute_rw_loss(torch.zeros(3), None, {"cu_seqlens": torch.tensor([0, 1, 2, 3])})


def test_collate_pairs_interleaves_chosen_and_rejected():
    rows = [
        {"chosen_ids": [5, 6, 7], "rejected_ids": [5, 8], "chosen_loss_mask": [0, 1, 1],
         "rejected_loss_mask": [0, 1]},
        {"chosen_ids": [1], "rejected_ids": [2, 3, 4, 9]},
    ]  # fmt: skip
    b = collate_pairs(rows, pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [5, 8, 0, 0], [1, 0, 0, 0], [2, 3, 4, 9]]
    assert b["attention_mask"].sum(-1).tolist() == [3, 2, 1, 4]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_collate_pairs_mask_length_mismatch_raises():
    with pytest.raises(ValueError, match="loss_mask"):
        collate_pairs([{"chosen_ids": [1, 2], "rejected_ids": [3], "chosen_loss_mask": [1]}])
