"""Turn-level GAE and per-sample lambda (AReaL 2.0's ``gae_timestep_unit``,
``gae_lambda`` as a function, ``gae_lambda_kwargs``): hand computations."""

from __future__ import annotations

import pytest
import torch
from test_ppo_actor import TinyEngine, cfg

from areal.api.cli_args import PPOActorConfig
from areal.trainer.ppo import lambda_fn
from areal.trainer.ppo.actor import PPOActor
from areal.utils.advantages import gae, turn_gae, turn_ids_from_loss_mask

# one row: prompt, turn 0 (positions 1-2), tool output (3-4), turn 1 (5), padding
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 0]])


def test_turn_ids_from_loss_mask_numbers_runs_of_loss_tokens():
    m = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    assert turn_ids_from_loss_mask(m).tolist() == [
        [-1, 0, 0, -1, -1, 1, -1, 2],
        [0, 0, 0, 0, -1, -1, -1, -1],
    ]


def test_turn_gae_matches_hand_computation_and_differs_from_token_gae():
    rewards = torch.tensor([[0.0, 0.1, 0.2, 9.0, 9.0, 1.0, 0.0]])  # 9s: outside the mask
    values = torch.tensor([[7.0, 0.5, 3.0, 7.0, 7.0, 0.2, 7.0]])
    adv, ret = turn_gae(rewards, values, MASK, turn_ids_from_loss_mask(MASK), 0.9, 0.8)
    # turn 1: delta = 1 + 0.9 * 0 - 0.2 = 0.8 = A_1
    # turn 0: R = 0.1 + 0.2, V = 0.5 (its first token): delta = 0.3 + 0.9 * 0.2 - 0.5
    #         = -0.02; A_0 = -0.02 + 0.9 * 0.8 * 0.8 = 0.556
    expect = torch.tensor([[0.0, 0.556, 0.556, 0.0, 0.0, 0.8, 0.0]])
    torch.testing.assert_close(adv, expect, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        ret, torch.tensor([[0.0, 1.056, 1.056, 0.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0
    )
    tok, _ = gae(rewards, values, MASK, 0.9, 0.8)
    assert not torch.allclose(tok, adv)  # per token the discount acts 3 times, not twice


def test_turn_gae_explicit_turn_ids_and_bad_ids():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.zeros(1, 7)
    # the given ids make positions 1-5 one turn (skipped numbers are fine)
    ids = torch.tensor([[-1, 3, 3, -1, -1, 3, -1]])
    adv, _ = turn_gae(rewards, values, MASK, ids, 0.5, 1.0)
    torch.testing.assert_close(adv, MASK.float())  # one turn: no discount at all
    with pytest.raises(ValueError, match="decrease"):
        turn_gae(rewards, values, MASK, torch.tensor([[-1, 1, 1, -1, -1, 0, -1]]), 0.5, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        turn_gae(rewards, values, MASK, torch.tensor([[-1, -1, 0, -1, -1, 1, -1]]), 0.5, 1.0)


def test_gae_per_sample_lambda_equals_rows_with_their_own_lambda():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    m = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    lam = torch.tensor([0.0, 0.5, 0.95])
    adv, ret = gae(r, v, m, 0.9, lam)
    for i in range(3):
        a_i, r_i = gae(r[i : i + 1], v[i : i + 1], m[i : i + 1], 0.9, float(lam[i]))
        torch.testing.assert_close(adv[i : i + 1], a_i)
        torch.testing.assert_close(ret[i : i + 1], r_i)
    with pytest.raises(ValueError, match="shape"):
        gae(r, v, m, 0.9, torch.tensor([0.5, 0.5]))


def test_builtin_lambda_functions_hand_values():
    ctx = {"timestep_lengths": torch.tensor([10, 40, 0, 1])}
    torch.testing.assert_close(
        lambda_fn.vapo_length_adaptive_gae(ctx, alpha=0.05),
        torch.tensor([0.0, 0.5, 0.0, 0.0]),  # 1 - 1/0.5 < 0 -> 0; 1 - 1/2; empty; 1 - 20
    )
    ctx = {"timestep_lengths": torch.tensor([3, 1, 0, 5])}
    torch.testing.assert_close(
        lambda_fn.relative_position_gae_lambda(ctx, q=0.25),
        torch.tensor([0.5, 1.0, 0.0, 0.25**0.25]),
    )
    torch.testing.assert_close(lambda_fn.constant_gae_lambda(ctx, value=0.7), torch.full((4,), 0.7))
    with pytest.raises(ValueError, match="alpha"):
        lambda_fn.vapo_length_adaptive_gae(ctx, alpha=0)
    with pytest.raises(ValueError, match="q="):
        lambda_fn.relative_position_gae_lambda(ctx, q=1.5)


def test_lambda_context_counts_tokens_and_turns():
    ctx = lambda_fn.gae_lambda_context(MASK, turn_ids_from_loss_mask(MASK), "turn")
    assert ctx["effective_token_lengths"].tolist() == [3]
    assert ctx["turn_counts"].tolist() == [2]
    assert ctx["timestep_lengths"].tolist() == [2]


def _batch():
    return dict(
        input_ids=torch.ones(2, 7, dtype=torch.long),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]),
        loss_mask=torch.tensor([[0, 1, 1, 0, 0, 1, 0], [0, 0, 1, 1, 1, 1, 1]]),
        logprobs=torch.zeros(2, 7),
        rewards=torch.tensor([1.0, -1.0]),
        values=torch.tensor([[0.0, 0.5, 0.1, 0.0, 0.0, 0.2, 0.0], [0.0, 0, 0.3, 0.1, 0, 0, 0.4]]),
    )


def test_actor_turn_level_gae_with_vapo_lambda_per_sequence():
    c = cfg(
        discount=0.9,
        gae_timestep_unit="turn",
        gae_lambda="areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae",
        gae_lambda_kwargs={"alpha": 1.0},
    )
    data = _batch()
    PPOActor(c, TinyEngine()).compute_advantages(data)
    # row 0: 2 turns -> lambda 1 - 1/2 = 0.5; row 1: 1 turn -> lambda 0
    # row 0 (reward 1 on position 5): A_1 = 1 - 0.2 = 0.8; A_0 = 0 + 0.9*0.2 - 0.5 +
    # 0.9*0.5*0.8 = 0.04; row 1: one turn, V = 0.3: A = -1 - 0.3 = -1.3
    expect = torch.tensor([[0, 0.04, 0.04, 0, 0, 0.8, 0], [0, 0, -1.3, -1.3, -1.3, -1.3, -1.3]])
    torch.testing.assert_close(data["advantages"], expect, atol=1e-6, rtol=0)
    # token level, same lambda function: lambda per row from 3 and 5 tokens
    c = cfg(
        discount=0.9,
        gae_lambda="areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae",
        gae_lambda_kwargs={"alpha": 1.0},
    )
    data = _batch()
    PPOActor(c, TinyEngine()).compute_advantages(data)
    lam = torch.tensor([1 - 1 / 3, 1 - 1 / 5])
    expect, _ = gae(
        torch.tensor([[0, 0, 0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0, 0, -1.0]]),
        _batch()["values"],
        _batch()["loss_mask"],
        0.9,
        lam,
    )
    torch.testing.assert_close(data["advantages"], expect)


def test_actor_turn_gae_keeps_kl_penalty_per_token():
    c = cfg(gae_timestep_unit="turn", kl_ctl=0.5)
    data = _batch()
    data.pop("values")
    data["ref_logp"] = data["logprobs"] - 0.2 * data["loss_mask"]  # k1 = 0.2 per token
    PPOActor(c, TinyEngine()).compute_advantages(data)
    # no critic, discount 1: the turn advantage is the outcome reward, plus -0.1 per token
    m = data["loss_mask"].bool()
    expect = torch.where(m, data["task_rewards"][:, None] - 0.1, 0.0)
    torch.testing.assert_close(data["advantages"], expect, atol=1e-6, rtol=0)


def test_gae_config_validation_and_bad_function_output():
    with pytest.raises(ValueError, match="gae_lambda"):
        PPOActorConfig(gae_lambda="")
    with pytest.raises(ValueError, match="gae_lambda"):
        PPOActorConfig(gae_lambda=1.5)
    with pytest.raises(ValueError, match="gae_timestep_unit"):
        PPOActorConfig(gae_timestep_unit="step")
    c = cfg(gae_lambda="areal.trainer.ppo.lambda_fn.constant_gae_lambda",
            gae_lambda_kwargs={"value": 2.0})  # fmt: skip
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        PPOActor(c, TinyEngine()).compute_advantages(_batch())
