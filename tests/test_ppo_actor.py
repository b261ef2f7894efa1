"""PPOActor / PPOCritic against a minimal in-test TrainEngine on a tiny torch model."""

from __future__ import annotations

import copy

import pytest
import torch

from areal.api.cli_args import (
    NormConfig,
    PPOActorConfig,
    PPOCriticConfig,
    RejectionSamplingConfig,
)
from areal.api.engine_api import TrainEngine
from areal.trainer.ppo.actor import PPOActor
from areal.trainer.ppo.critic import PPOCritic
from areal.utils import functional as F
from areal.utils import stats_tracker
from areal.utils.data import (
    pack_tensor_dict,
    select_sequences,
    split_padded_tensor_dict_into_mb_list,
)

VOCAB = 11


class TinyModel(torch.nn.Module):
    """Bigram model: the distribution of token i depends on token i-1 only."""

    def __init__(self, seed: int = 0, critic: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=g) * 0.5)
        self.out = torch.nn.Parameter(torch.randn(6, 1 if critic else VOCAB, generator=g) * 0.5)
        self.critic = critic

    def aligned(self, input_ids: torch.Tensor, attn: torch.Tensor):
        """Token-aligned outputs [B, T]: logprob (or value) of token i given the prefix < i."""
        h = self.emb[input_ids[:, :-1]] @ self.out  # [B, T-1, V] from position i-1
        bs, t = input_ids.shape
        out = torch.zeros(bs, t)
        ent = torch.zeros(bs, t)
        if self.critic:
            out = torch.cat([torch.zeros(bs, 1), h.squeeze(-1)], 1)
        else:
            lp = torch.log_softmax(h, -1)
            out = torch.cat(
                [torch.zeros(bs, 1), lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)], 1
            )
            ent = torch.cat([torch.zeros(bs, 1), -(lp.exp() * lp).sum(-1)], 1)
        return out * attn, ent * attn


class TinyEngine(TrainEngine):
    """Follows the train_batch contract: packs, splits into micro-batches, weights them."""

    def __init__(self, seed=0, critic=False, mb_seqs=None, lr=0.5, mb_spec=None):
        self.model = TinyModel(seed, critic)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.mb_seqs = mb_seqs
        self.mb_spec = mb_spec  # when set: the real micro-batch splitter
        self.mb_token_counts: list[list[int]] = []
        self.version = 3

    def initialize(self, addr, ft_spec, **kw):
        pass

    def destroy(self):
        pass

    def train(self, mode=True):
        return self

    def forward_batch(self, input_, output_seqlens=None, post_hook=None, aggregate_fn=None):
        with torch.no_grad():
            return self.model.aligned(input_["input_ids"], input_["attention_mask"])[0]

    def train_batch(self, input_, loss_fn, loss_weight_fn):
        bs = input_["attention_mask"].shape[0]
        step = self.mb_seqs or bs
        if self.mb_spec is not None:
            split = split_padded_tensor_dict_into_mb_list(input_, self.mb_spec)
            self.mb_token_counts.append(split.mb_token_counts)
            mbs = split.mbs
        else:
            mbs = [
                select_sequences(input_, list(range(s, min(bs, s + step))))
                for s in range(0, bs, step)
            ]
        self.opt.zero_grad()
        losses, weights = [], []
        for mb in mbs:
            out, ent = self.model.aligned(mb["input_ids"], mb["attention_mask"])
            m = mb["attention_mask"].bool()
            packed = pack_tensor_dict(mb)
            losses.append(loss_fn(out[m], ent[m], packed))
            weights.append(loss_weight_fn(packed).float())
        total = torch.stack(weights).sum()
        loss = sum(lo * w / total for lo, w in zip(losses, weights))
        loss.backward()
        self.opt.step()
        return {"loss": float(loss.detach()), "lr": 0.5}

    def eval_batch(self, input_, loss_fn, loss_weight_fn):
        return None

    def save(self, meta):
        pass

    def load(self, meta):
        pass

    def update_weights(self, meta):
        pass

    def get_version(self):
        return self.version


def make_batch(seed=0, bs=4, t=7):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (bs, t), generator=g)
    lens = torch.tensor([7, 5, 6, 4, 7, 3, 6, 5][:bs])
    prompt = torch.tensor([2, 2, 3, 1, 2, 1, 2, 2][:bs])
    ar = torch.arange(t)[None]
    attn = (ar < lens[:, None]).long()
    loss_mask = ((ar >= prompt[:, None]) & (ar < lens[:, None])).long()
    input_ids = input_ids * attn
    logprobs = (-torch.rand(bs, t, generator=g) - 0.5) * loss_mask
    return dict(
        input_ids=input_ids,
        attention_mask=attn,
        loss_mask=loss_mask,
        logprobs=logprobs.float(),
        versions=torch.where(loss_mask.bool(), 2, -1),
        rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0][:bs]),
    )


def cfg(**kw):
    base = dict(kl_ctl=0.0, ppo_n_minibatches=1, group_size=2, reward_clip=20.0)
    base.update(kw)
    return PPOActorConfig(**base)


# ------------------------------------------------------------------ advantages
def test_compute_advantages_grpo_group_norm_broadcasts_to_tokens():
    data = make_batch()
    norm = NormConfig(mean_level="group", std_level="group", group_size=2, eps=1e-12)
    actor = PPOActor(cfg(reward_norm=norm), TinyEngine())
    out = actor.compute_advantages(data)
    assert out is data
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # group 1: [1, 0] -> mean .5, unbiased std sqrt(.5); group 2: all 0 -> 0
    seq_adv = torch.tensor([0.5 / 0.5**0.5, -0.5 / 0.5**0.5, 0.0, 0.0])
    m = data["loss_mask"].bool()
    assert torch.allclose(data["advantages"], seq_adv[:, None] * m, atol=1e-5)
    assert torch.allclose(data["old_logp"], data["logprobs"] * m)
    assert torch.equal(data["prox_logp"], data["old_logp"])  # non-decoupled: prox == old
    assert torch.allclose(
        data["task_rewards"], F.group_normalization(r, None, "group", "group", 2, eps=1e-12)
    )


def test_compute_advantages_ids_of_fixed_layout_identical_to_group_size():
    norm = NormConfig(mean_level="group", std_level="group", group_size=2)
    adv_norm = NormConfig(mean_level="batch", std_level="batch")
    plain, tagged = make_batch(bs=8), make_batch(bs=8)
    tagged["group_ids"] = torch.tensor([3, 3, 8, 8, 1, 1, 6, 6])
    tagged["episode_ids"] = torch.arange(8) + 20
    for data in (plain, tagged):
        PPOActor(cfg(reward_norm=norm, adv_norm=adv_norm), TinyEngine()).compute_advantages(data)
    assert torch.equal(plain["advantages"], tagged["advantages"])
    assert torch.equal(plain["task_rewards"], tagged["task_rewards"])


def test_compute_advantages_agent_episodes_of_several_rows_normalised_over_episodes():
    # one group of 3 episodes exported one row per call: 1, 3 and 2 calls (6 rows, not a
    # multiple of group_size=3), rewards 1, 0, 0.5; a second group of two 1-call episodes
    data = make_batch(bs=8)
    data["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 2.0, 0.0])
    data["group_ids"] = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    data["episode_ids"] = torch.tensor([0, 1, 1, 1, 2, 2, 3, 4])
    norm = NormConfig(mean_level="group", std_level="group", group_size=3, eps=1e-12)
    PPOActor(cfg(reward_norm=norm), TinyEngine()).compute_advantages(data)
    m = data["loss_mask"].bool()
    # episodes 1, 0, .5: mean .5, unbiased std .5; episodes 2, 0: mean 1, std sqrt(2)
    seq = torch.tensor([1.0, -1.0, -1.0, -1.0, 0.0, 0.0, 2**-0.5, -(2**-0.5)])
    assert torch.allclose(data["advantages"], seq[:, None] * m, atol=1e-5)


def test_compute_advantages_reward_bias_scaling_clip_and_no_norm():
    data = make_batch()
    actor = PPOActor(cfg(reward_bias=-0.5, reward_scaling=10.0, reward_clip=4.0), TinyEngine())
    actor.compute_advantages(data)
    m = data["loss_mask"].bool()
    seq = torch.tensor([4.0, -4.0, -4.0, -4.0])  # (r - .5) * 10 = +-5, clipped to +-4
    assert torch.allclose(data["advantages"], seq[:, None] * m)


def test_compute_advantages_rloo_and_drgrpo():
    data = make_batch(bs=4)
    data["rewards"] = torch.tensor([1.0, 0.0, 3.0, 1.0])
    rloo = NormConfig(mean_level="group", mean_leave1out=True, std_level=None, group_size=2)
    PPOActor(cfg(reward_norm=rloo), TinyEngine()).compute_advantages(data)
    m = data["loss_mask"].bool()
    assert torch.allclose(data["advantages"], torch.tensor([1.0, -1.0, 2.0, -2.0])[:, None] * m)
    data = make_batch(bs=4)
    data["rewards"] = torch.tensor([1.0, 0.0, 3.0, 1.0])
    dr = NormConfig(mean_level="group", std_level=None, group_size=2)
    PPOActor(cfg(reward_norm=dr), TinyEngine()).compute_advantages(data)
    assert torch.allclose(data["advantages"], torch.tensor([0.5, -0.5, 1.0, -1.0])[:, None] * m)


def test_compute_advantages_overlong_penalty_and_no_eos_mask():
    data = make_batch(bs=4)  # response lengths 5, 3, 3, 3 ; row 0 fills the width (no EOS)
    data["rewards"] = torch.ones(4)
    c = cfg(
        overlong_reward_penalty=True,
        overlong_tokens=2,
        overlong_penalty_factor=1.0,
        max_new_tokens=4,
        mask_no_eos_with_zero=True,
    )
    PPOActor(c, TinyEngine()).compute_advantages(data)
    # expected length 2: len 3 -> -0.5 ; row 0 (no EOS) -> 0
    m = data["loss_mask"].bool()
    assert torch.allclose(data["advantages"], torch.tensor([0.0, 0.5, 0.5, 0.5])[:, None] * m)


def test_compute_advantages_kl_in_reward_matches_loop():
    data = make_batch(bs=4)
    g = torch.Generator().manual_seed(5)
    data["ref_logp"] = (-torch.rand(4, 7, generator=g)) * data["loss_mask"]
    actor = PPOActor(cfg(kl_ctl=0.3, kl_estimator="k3"), TinyEngine())
    actor.compute_advantages(data)
    m = data["loss_mask"].bool()
    kl = F.kl_estimator(data["logprobs"], data["ref_logp"], "k3")
    for b in range(4):
        idx = m[b].nonzero().flatten().tolist()
        for j, t in enumerate(idx):
            expected = data["rewards"][b].item() - 0.3 * sum(kl[b, u].item() for u in idx[j:])
            assert data["advantages"][b, t].item() == pytest.approx(expected, abs=1e-5)


def test_compute_advantages_gae_with_values_sets_returns():
    data = make_batch(bs=4)
    g = torch.Generator().manual_seed(7)
    data["values"] = torch.randn(4, 7, generator=g) * data["loss_mask"]
    actor = PPOActor(cfg(discount=0.9, gae_lambda=0.8), TinyEngine())
    actor.compute_advantages(data)
    m = data["loss_mask"].bool()
    for b in range(4):
        idx = m[b].nonzero().flatten().tolist()
        last = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            r = data["rewards"][b].item() if j == len(idx) - 1 else 0.0
            nv = data["values"][b, idx[j + 1]].item() if j + 1 < len(idx) else 0.0
            last = r + 0.9 * nv - data["values"][b, t].item() + 0.9 * 0.8 * last
            assert data["advantages"][b, t].item() == pytest.approx(last, abs=1e-5)
            assert data["returns"][b, t].item() == pytest.approx(
                last + data["values"][b, t].item(), abs=1e-5
            )


def test_compute_advantages_batch_adv_norm_over_tokens():
    data = make_batch(bs=4)
    actor = PPOActor(
        cfg(adv_norm=NormConfig(mean_level="batch", std_level="batch", eps=1e-12)), TinyEngine()
    )
    actor.compute_advantages(data)
    m = data["loss_mask"].bool()
    a = data["advantages"][m]
    assert a.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert a.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


def test_compute_advantages_decoupled_keeps_behaviour_and_proximal():
    data = make_batch(bs=4)
    eng = TinyEngine()
    actor = PPOActor(cfg(recompute_logprob=True, use_decoupled_loss=True), eng)
    data["prox_logp"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    m = data["loss_mask"].bool()
    assert torch.allclose(data["old_logp"], data["logprobs"] * m)
    assert torch.allclose(data["prox_logp"], eng.forward_batch(data) * m)
    del data["prox_logp"]
    with pytest.raises(ValueError, match="prox_logp"):
        actor.compute_advantages(data)


def test_actor_sapo_with_decoupled_loss_raises():
    c = cfg(recompute_logprob=True)
    c.use_sapo_loss = True
    c.use_decoupled_loss = True
    with pytest.raises(ValueError, match="use_decoupled_loss"):
        PPOActor(c, TinyEngine())


# ------------------------------------------------------------------ update
def _reference_step(engine, data, lr=0.5, **loss_kw):
    """One SGD step on the full padded batch with the loss written out directly."""
    model = copy.deepcopy(engine.model)
    logp, _ = model.aligned(data["input_ids"], data["attention_mask"])
    loss, _ = F.ppo_actor_loss_fn(
        logp,
        data["prox_logp"],
        data["old_logp"],
        data["advantages"],
        loss_mask=data["loss_mask"],
        **loss_kw,
    )
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return model


@pytest.mark.parametrize("mb_seqs", [None, 1, 3])
@pytest.mark.parametrize(
    "agg,extra",
    [
        ("token-mean", {}),
        ("seq-mean-token-mean", {}),
        ("seq-mean-token-sum-norm", {"loss_norm_constant": 6.0}),
    ],
)
def test_ppo_update_matches_direct_loss_for_any_microbatch_split(mb_seqs, agg, extra):
    torch.manual_seed(0)
    data = make_batch(bs=6)
    eng = TinyEngine(mb_seqs=mb_seqs)
    c = cfg(
        recompute_logprob=True,
        use_decoupled_loss=True,
        behav_imp_weight_cap=1.5,
        eps_clip=0.1,
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
    )
    c.loss_agg_mode = agg
    if extra:
        c.loss_norm_constant = extra["loss_norm_constant"]
    actor = PPOActor(c, eng)
    # a slightly different proximal policy so that weights, clipping and the cap all act
    data["prox_logp"] = actor.compute_logp(data) + 0.3 * torch.randn(6, 7) * data["loss_mask"]
    actor.compute_advantages(data)
    # the legacy cap 1.5 (token_mask) is migrated to this rejection_sampling config
    rs = dict(level="token", action="mask", metric="ratio", upper=1.5)
    ref = _reference_step(
        eng, data, eps_clip=0.1, rejection_sampling=rs, loss_agg_mode=agg, **extra
    )
    stats = actor.ppo_update(data)
    assert len(stats) == 1
    for p, q in zip(eng.model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    out = stats_tracker.export()
    assert 0 < out["ppo_actor/update/clip_ratio/avg"] < 1
    assert out["ppo_actor/update/behave_imp_weight/max"] <= 1.5
    assert out["ppo_actor/update/staleness/avg"] == 1.0  # version 3, tokens from version 2
    assert "ppo_actor/advantages/avg" in out and "ppo_actor/update/loss" in out


def test_ppo_update_minibatches_steps_and_loss_improves_objective():
    torch.manual_seed(0)
    data = make_batch(bs=8)
    eng = TinyEngine()
    actor = PPOActor(
        cfg(
            ppo_n_minibatches=4,
            reward_norm=NormConfig(mean_level="group", std_level=None, group_size=2),
        ),
        eng,
    )
    data["logprobs"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    m = data["loss_mask"].bool()
    before = (actor.compute_logp(data) * data["advantages"])[m].sum()
    stats = actor.ppo_update(data)
    stats_tracker.export()
    assert len(stats) == 4
    after = (actor.compute_logp(data) * data["advantages"])[m].sum()
    assert after > before  # policy moved towards positive-advantage tokens


def _spy_actor_loss(monkeypatch):
    """Record every call of the actor's PPO loss: its inputs and per-token stats."""
    import areal.trainer.ppo.actor as actor_mod

    calls = []
    real = actor_mod.ppo_actor_loss_fn

    def spy(logprobs, prox, old, adv, eps, mask, **kw):
        loss, stat = real(logprobs, prox, old, adv, eps, mask, **kw)
        calls.append(
            dict(
                logprobs=logprobs.detach(),
                prox=prox.detach(),
                mask=mask.bool(),
                cu=kw.get("cu_seqlens"),
                level=kw.get("importance_sampling_level"),
                weight=stat["importance_weight"].detach(),
            )
        )
        return loss, stat

    monkeypatch.setattr(actor_mod, "ppo_actor_loss_fn", spy)
    return calls


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_ppo_update_gspo_ratio_is_per_sequence_geometric_mean(monkeypatch, level):
    """GSPO (importance_sampling_level="sequence") through PPOActor.ppo_update: every token
    of a sequence carries one importance ratio, the geometric mean of its tokens' ratios
    exp(mean_t(logp_t - prox_t)); token-level PPO (the control) gives ratios that differ
    within a sequence, so the check can fail."""
    torch.manual_seed(0)
    calls = _spy_actor_loss(monkeypatch)
    data = make_batch(bs=4)
    eng = TinyEngine()
    actor = PPOActor(cfg(importance_sampling_level=level, ppo_n_minibatches=2), eng)
    # proximal logprobs off the current policy, so token ratios differ from 1 and each other
    data["prox_logp"] = actor.compute_logp(data) + 0.3 * torch.randn(4, 7) * data["loss_mask"]
    actor.compute_advantages(data)
    actor.ppo_update(data)
    out = stats_tracker.export()
    assert calls and all(c["level"] == level for c in calls)
    n_seqs = spread = 0
    for c in calls:
        cu = c["cu"].tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            m = c["mask"][s:e]
            if m.sum() < 2:
                continue
            n_seqs += 1
            token_ratio = torch.exp(c["logprobs"][s:e] - c["prox"][s:e])[m]
            w = c["weight"][s:e][m]
            spread = max(spread, float(token_ratio.max() - token_ratio.min()))
            if level == "sequence":
                geo = torch.exp(torch.log(token_ratio).mean())
                torch.testing.assert_close(w, geo.expand_as(w), rtol=1e-5, atol=0)
            else:
                torch.testing.assert_close(w, token_ratio, rtol=1e-5, atol=0)
    assert n_seqs >= 4 and spread > 0.1  # real per-token variation inside sequences
    w_avg = out["ppo_actor/update/importance_weight/avg"]
    assert w_avg != pytest.approx(1.0, abs=1e-3)


def test_ppo_update_sapo_m2po_run_and_log():
    torch.manual_seed(0)
    for kw, key in (
        (dict(use_sapo_loss=True), "ppo_actor/update/sapo_soft_gate/avg"),
        (
            dict(m2_threshold=0.01, recompute_logprob=True, use_decoupled_loss=True),
            "ppo_actor/update/m2po_kept_ratio/avg",
        ),
    ):
        data = make_batch(bs=4)
        eng = TinyEngine()
        actor = PPOActor(cfg(**kw), eng)
        data["prox_logp"] = actor.compute_logp(data)
        actor.compute_advantages(data)
        actor.ppo_update(data)
        out = stats_tracker.export()
        assert key in out, (kw, sorted(out))
        if "m2_threshold" in kw:
            assert out[key] < 1.0  # stale behaviour logprobs -> some tokens masked


# ------------------------------------------------------------------ kk micro-batches
def test_ppo_update_kk_micro_batches_same_update_as_ffd_more_even():
    from areal.api.cli_args import MicroBatchSpec

    results = {}
    for algo in ("ffd", "kk", None):
        torch.manual_seed(0)
        data = make_batch(bs=8)
        spec = (
            None if algo is None else MicroBatchSpec(max_tokens_per_mb=18, packing_algorithm=algo)
        )
        eng = TinyEngine(mb_spec=spec)
        c = cfg(
            recompute_logprob=True,
            use_decoupled_loss=True,
            rejection_sampling=RejectionSamplingConfig(upper=1.5),
            reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
        )
        actor = PPOActor(c, eng)
        data["prox_logp"] = actor.compute_logp(data) + 0.3 * torch.randn(8, 7) * data["loss_mask"]
        actor.compute_advantages(data)
        stats = actor.ppo_update(data)
        stats_tracker.export()
        results[algo] = (stats[0]["loss"], list(eng.model.parameters()), eng.mb_token_counts)
    # sequence lengths 7 5 6 4 7 3 6 5 (43 tokens) under 18 tokens per micro-batch
    ffd_counts, kk_counts = results["ffd"][2][0], results["kk"][2][0]
    assert len(kk_counts) == len(ffd_counts) == 3
    assert max(kk_counts) - min(kk_counts) < max(ffd_counts) - min(ffd_counts)
    for algo in ("ffd", "kk"):
        assert results[algo][0] == pytest.approx(results[None][0], abs=1e-6)
        for p, q in zip(results[algo][1], results[None][1]):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


# ------------------------------------------------------- proximal log-linear approximation
def _versioned_setup():
    """A tiny model trained 3 real PPO steps (versions 0 -> 3, 4 minibatches each, as the
    updates under test) and a batch whose rows were generated (behaviour logprobs) by
    versions [0, 0, 1, 1, 2, 2, 3, 3]."""
    torch.manual_seed(0)
    eng = TinyEngine(lr=0.3)
    c = cfg(
        recompute_logprob=True,
        use_decoupled_loss=True,
        ppo_n_minibatches=4,
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
    )
    trainer = PPOActor(c, eng)
    data = make_batch(seed=11, bs=8)
    row_version = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    m = data["loss_mask"].bool()
    behave = torch.zeros(8, 7)
    for v in range(4):
        eng.version = v
        rows = row_version == v
        behave[rows] = trainer.compute_logp(data)[rows]
        if v == 3:
            break
        train = make_batch(seed=20 + v, bs=8)
        train["logprobs"] = trainer.compute_logp(train)
        train["versions"] = torch.where(train["loss_mask"].bool(), v, -1)
        train["prox_logp"] = train["logprobs"].clone()
        trainer.compute_advantages(train)
        trainer.ppo_update(train)
    stats_tracker.export()
    data["logprobs"] = behave * m
    data["versions"] = torch.where(m, row_version[:, None], -1)
    exact_prox = trainer.compute_logp(data) * m
    return eng, data, exact_prox


def _update(eng, data, method, n_mbs, prox=None):
    eng = copy.deepcopy(eng)
    data = {k: v.clone() for k, v in data.items()}
    c = cfg(
        recompute_logprob=True,
        use_decoupled_loss=True,
        ppo_n_minibatches=n_mbs,
        prox_logp_method=method,
        rejection_sampling=RejectionSamplingConfig(action="clamp", upper=1.02),
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
    )
    actor = PPOActor(c, eng)
    if prox is not None:
        data["prox_logp"] = prox.clone()
    actor.compute_advantages(data)
    actor.ppo_update(data)
    return eng, data, stats_tracker.export()


def test_loglinear_prox_against_exact_recompute_on_trained_model():
    eng, data, exact = _versioned_setup()
    m = data["loss_mask"].bool()
    stale = m & (data["versions"] < 3)
    assert (exact - data["logprobs"]).abs()[stale].mean() > 1e-2  # versions really differ
    # fresh tokens (version 3 = the proximal weights): the approximation is the behaviour
    # logprob, which is exact; first minibatch (theta == proximal): exact everywhere
    theta = exact + 0.05 * torch.randn(exact.shape) * m  # any current-policy logprobs
    approx = F.loglinear_prox_logp(data["logprobs"], theta, data["versions"], 3, 0.5)
    fresh = m & (data["versions"] == 3)
    assert torch.equal(approx[fresh], data["logprobs"][fresh])
    first = F.loglinear_prox_logp(data["logprobs"], exact, data["versions"], 3, 0.0)
    torch.testing.assert_close(first[m], exact[m], atol=1e-6, rtol=0)

    # inside real updates ('metrics' recomputes and logs the approximation's error)
    _, _, one = _update(eng, data, "metrics", 1, prox=exact)
    key = "ppo_actor/update/compute_logp/{}/abs_error/{}"
    assert one[key.format("loglinear", "max")] < 1e-6
    assert one[key.format("rollout", "avg")] > 1e-2
    # 4 minibatches, over 4 minibatch orders: always closer than the behaviour logprobs,
    # about 5x closer on average (measured mean abs error 0.0043 vs 0.0221; with AReaL's
    # version mapping, v_prox = current - 1 and v_theta = current: 0.0136)
    ratios = []
    for seed in range(4):
        torch.manual_seed(seed)
        _, _, four = _update(eng, data, "metrics", 4, prox=exact)
        ll, ro = four[key.format("loglinear", "avg")], four[key.format("rollout", "avg")]
        assert 0 < ll < ro, (seed, ll, ro)
        ratios.append(ll / ro)
    assert sum(ratios) / len(ratios) < 0.5, ratios


def test_loglinear_update_without_prox_forward_equals_recompute_in_one_minibatch():
    eng, data, exact = _versioned_setup()
    calls = []
    eng_ll = copy.deepcopy(eng)
    orig = eng_ll.forward_batch
    eng_ll.forward_batch = lambda *a, **k: calls.append(1) or orig(*a, **k)
    c = cfg(
        recompute_logprob=True,
        use_decoupled_loss=True,
        prox_logp_method="loglinear",
        rejection_sampling=RejectionSamplingConfig(action="clamp", upper=1.02),
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
    )
    d = {k: v.clone() for k, v in data.items()}
    actor = PPOActor(c, eng_ll)
    actor.compute_advantages(d)
    assert "prox_logp" not in d
    actor.ppo_update(d)
    out = stats_tracker.export()
    assert calls == []  # no forward pass outside the training step
    assert "ppo_actor/update/compute_logp/loglinear/approx_logp/avg" in out
    assert out["ppo_actor/update/rs_filtered_fraction/avg"] > 0  # clamp acted
    ref, _, _ = _update(eng, data, "recompute", 1, prox=exact)
    for p, q in zip(eng_ll.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    # without versions the approximation cannot work: a clear error
    d = {k: v.clone() for k, v in data.items() if k != "versions"}
    with pytest.raises(ValueError, match="versions"):
        PPOActor(c, copy.deepcopy(eng)).compute_advantages(d)
    # a recomputed prox_logp given anyway is used as it is (as AReaL)
    d["prox_logp"] = exact.clone()
    PPOActor(c, copy.deepcopy(eng)).compute_advantages(d)
    assert torch.equal(d["prox_logp"], exact)


def test_train_step_loglinear_skips_compute_logp_recompute_calls_it_once(tmp_path):
    from areal.api.cli_args import GRPOConfig
    from areal.api.io_struct import StepInfo
    from areal.trainer.rl_trainer import PPOTrainer

    class Recorder:
        """Accepts any method call, records its name, returns a canned value."""

        def __init__(self, **returns):
            self.calls: list[str] = []
            self._returns = returns

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)

            def call(*args, **kwargs):
                self.calls.append(name)
                r = self._returns.get(name)
                return r(*args, **kwargs) if callable(r) else r

            return call

    counts = {}
    for method in ("loglinear", "recompute"):
        config = GRPOConfig()
        config.actor = cfg(recompute_logprob=True, use_decoupled_loss=True, prox_logp_method=method)
        trainer = PPOTrainer.__new__(PPOTrainer)
        trainer.config = config
        trainer.actor = Recorder(
            # the step holds the batch on the workers: a ref, results stored there
            put_batch=lambda b: Recorder(apply=[(0, 0.0, 0.0)]),
            compute_logp=lambda b, **kw: None,
            compute_advantages=lambda b: b,
            ppo_update=[{"loss": 0.0}],
            export_stats={},
        )
        trainer.rollout = Recorder(prepare_batch=lambda *a, **k: make_batch(bs=4))
        trainer.ref = trainer.critic = trainer.teacher = None
        trainer.server_watchdog = Recorder(step_stats={})
        trainer.health = Recorder(batch_signals={})
        trainer.weight_sync = Recorder()
        trainer.weight_update_meta = Recorder()
        trainer.train_dataloader = None
        trainer.log_dir = str(tmp_path)
        trainer._train_step(StepInfo(0, 0, 3, 10), None, None, None)
        counts[method] = trainer.actor.calls.count("compute_logp")
        assert "ppo_update" in trainer.actor.calls
    assert counts == {"loglinear": 0, "recompute": 1}


# ------------------------------------------------------------------ critic
def test_critic_update_matches_direct_clipped_value_loss():
    torch.manual_seed(0)
    data = make_batch(bs=4)
    eng = TinyEngine(critic=True, mb_seqs=1)
    critic = PPOCritic(PPOCriticConfig(ppo_n_minibatches=1, eps_clip=0.05), eng)
    data["values"] = critic.compute_values(data)
    actor = PPOActor(cfg(discount=1.0, gae_lambda=0.9), TinyEngine())
    actor.compute_advantages(data)
    model = copy.deepcopy(eng.model)
    v, _ = model.aligned(data["input_ids"], data["attention_mask"])
    loss, _ = F.ppo_critic_loss_fn(v, data["values"], data["returns"], 0.05, data["loss_mask"])
    loss.backward()
    critic.ppo_update(data)
    for p, q in zip(eng.model.parameters(), model.parameters()):
        assert torch.allclose(p, q.detach() - 0.5 * q.grad, atol=1e-6)
    out = stats_tracker.export()
    assert "ppo_critic/value_loss/avg" in out


# ------------------------------------------------------------- hosting on another engine
def test_host_mixins_put_the_same_algorithm_on_any_engine():
    """The hosting pattern with a second engine (TinyEngine, not FSDP): the mixin-built
    classes give the same advantages and update as the algorithm composed by hand."""
    from areal.trainer.ppo.actor import PPOActorHost
    from areal.trainer.ppo.critic import PPOCriticHost

    class ConfiguredTinyEngine(TinyEngine):
        def __init__(self, config):
            super().__init__(critic=isinstance(config, PPOCriticConfig), mb_seqs=2)
            self.config = config

    class TinyPPOActor(PPOActorHost, ConfiguredTinyEngine):
        pass

    class TinyPPOCritic(PPOCriticHost, ConfiguredTinyEngine):
        pass

    c = cfg(ppo_n_minibatches=2, discount=1.0, gae_lambda=0.9)
    hosted, by_hand = TinyPPOActor(c), PPOActor(c, TinyEngine(mb_seqs=2))
    assert hosted.actor.engine is hosted and isinstance(hosted.actor, PPOActor)
    critic_cfg = PPOCriticConfig(ppo_n_minibatches=1, eps_clip=0.05)
    hosted_critic = TinyPPOCritic(critic_cfg)
    by_hand_critic = PPOCritic(critic_cfg, TinyEngine(critic=True, mb_seqs=2))
    a, b = make_batch(bs=8), make_batch(bs=8)
    a["values"] = hosted_critic.compute_values(a)
    b["values"] = by_hand_critic.compute_values(b)
    torch.testing.assert_close(a["values"], b["values"])
    a["prox_logp"], b["prox_logp"] = hosted.compute_logp(a), by_hand.compute_logp(b)
    hosted.compute_advantages(a)
    by_hand.compute_advantages(b)
    torch.testing.assert_close(a["advantages"], b["advantages"])
    torch.manual_seed(3)
    stats_a = hosted.ppo_update(a) + hosted_critic.ppo_update(a)
    torch.manual_seed(3)
    stats_b = by_hand.ppo_update(b) + by_hand_critic.ppo_update(b)
    stats_tracker.export()
    assert [s["loss"] for s in stats_a] == pytest.approx([s["loss"] for s in stats_b])
    for p, q in zip(hosted.model.parameters(), by_hand.engine.model.parameters()):
        torch.testing.assert_close(p, q)
    moved = [
        not torch.equal(p, q) for p, q in zip(hosted.model.parameters(), TinyModel().parameters())
    ]
    assert any(moved)  # the update did change the hosted weights


# ------------------------------------------------------------------ FSDP, 2 gloo ranks
def _fsdp_ppo_session(rank, world_size, path):
    from areal.api.cli_args import OptimizerConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.trainer.ppo.actor import FSDPPPOActor

    torch.manual_seed(0)
    c = PPOActorConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        num_threads=1,
        optimizer=OptimizerConfig(
            lr=1e-3, weight_decay=0.0, warmup_steps_proportion=0.0, gradient_clipping=1.0
        ),
        group_size=2,
        ppo_n_minibatches=1,
        kl_ctl=0.0,
        recompute_logprob=True,
        use_decoupled_loss=True,
        behav_imp_weight_cap=3.0,
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
        adv_norm=NormConfig(mean_level="batch", std_level="batch"),
    )
    eng = FSDPPPOActor(c)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    g = torch.Generator().manual_seed(1)
    bs, t = 8, 12
    lens = torch.tensor([12, 7, 10, 5, 12, 9, 6, 11])
    ids = torch.randint(3, 400, (bs, t), generator=g)
    ar = torch.arange(t)[None]
    attn = (ar < lens[:, None]).long()
    loss_mask = ((ar >= 3) & attn.bool()).long()
    data = dict(
        input_ids=ids * attn,
        attention_mask=attn,
        loss_mask=loss_mask,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]),
    )
    noise = 0.2 * torch.randn(bs, t, generator=g)
    rows = slice(rank * bs // world_size, (rank + 1) * bs // world_size)
    data = {k: v[rows] for k, v in data.items()}
    data["prox_logp"] = eng.compute_logp(data)
    data["logprobs"] = (data["prox_logp"] + noise[rows]) * data["loss_mask"]
    eng.compute_advantages(data)
    eng.ppo_update(data)
    full = eng._full_state_dict()  # collective: every rank calls it
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


@pytest.mark.slow
def test_ppo_update_two_ranks_matches_one_rank(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _dist_helpers import run_ranks
    from conftest import build_tiny_qwen2

    path = build_tiny_qwen2(str(tmp_path / "m"))
    one = run_ranks(_fsdp_ppo_session, 1, (path,))[0]
    two = run_ranks(_fsdp_ppo_session, 2, (path,))[0]
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(path).state_dict()
    moved = 0.0
    for k, v in one.items():
        assert torch.allclose(v, two[k], atol=2e-5), k
        if k in init:
            moved = max(moved, (v - init[k]).abs().max().item())
    assert moved > 1e-5  # the update really changed the weights


def _fsdp_loglinear_session(rank, world_size, path, method):
    from areal.api.cli_args import OptimizerConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.trainer.ppo.actor import FSDPPPOActor

    torch.manual_seed(0)
    c = PPOActorConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        num_threads=1,
        optimizer=OptimizerConfig(
            lr=1e-3, weight_decay=0.0, warmup_steps_proportion=0.0, gradient_clipping=1.0
        ),
        group_size=2,
        ppo_n_minibatches=1,
        kl_ctl=0.0,
        use_decoupled_loss=True,
        prox_logp_method=method,
        rejection_sampling=RejectionSamplingConfig(level="sequence", action="clamp", upper=1.05),
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
    )
    eng = FSDPPPOActor(c)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    eng.set_version(4)
    g = torch.Generator().manual_seed(1)
    bs, t = 8, 12
    lens = torch.tensor([12, 7, 10, 5, 12, 9, 6, 11])
    ar = torch.arange(t)[None]
    attn = (ar < lens[:, None]).long()
    loss_mask = ((ar >= 3) & attn.bool()).long()
    data = dict(
        input_ids=torch.randint(3, 400, (bs, t), generator=g) * attn,
        attention_mask=attn,
        loss_mask=loss_mask,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]),
        versions=torch.where(loss_mask.bool(), torch.tensor([4, 4, 3, 3, 2, 2, 1, 1])[:, None], -1),
    )
    exact = eng.compute_logp(data)
    data["logprobs"] = (exact + 0.1 * torch.randn(bs, t, generator=g)) * loss_mask
    fresh = data["versions"] == 4
    data["logprobs"][fresh] = exact[fresh]  # generated by these very weights
    if method != "loglinear":
        data["prox_logp"] = exact
    eng.compute_advantages(data)
    eng.ppo_update(data)
    out = stats_tracker.export()
    return {k: v.clone() for k, v in eng._full_state_dict().items()}, out


@pytest.mark.slow
def test_fsdp_loglinear_one_minibatch_same_update_as_recompute(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _dist_helpers import run_ranks
    from conftest import build_tiny_qwen2

    path = build_tiny_qwen2(str(tmp_path / "m"))
    ll, ll_stats = run_ranks(_fsdp_loglinear_session, 1, (path, "loglinear"))[0]
    rc, rc_stats = run_ranks(_fsdp_loglinear_session, 1, (path, "metrics"))[0]
    assert "ppo_actor/update/compute_logp/loglinear/approx_logp/avg" in ll_stats
    assert rc_stats["ppo_actor/update/compute_logp/loglinear/abs_error/max"] < 1e-5
    assert rc_stats["ppo_actor/update/rs_filtered_fraction/avg"] > 0
    for k, v in rc.items():
        torch.testing.assert_close(ll[k], v, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_grpo_trainer_loglinear_kk_stale_steps_without_proximal_forward(
    tiny_lm_dir, tmp_path, monkeypatch
):
    """The GRPO preset with prox_logp_method=loglinear and kk packing, 3 asynchronous
    steps (staleness up to 2) through the real trainer, servers and workers."""
    from test_presets_train import ROOT, _cpu_overrides

    from areal import PPOTrainer
    from areal.api import cli_args
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    monkeypatch.setenv("MODEL_PATH", tiny_lm_dir)
    overrides = _cpu_overrides(tmp_path) + [
        "actor.prox_logp_method=loglinear",
        "actor.mb_spec.packing_algorithm=kk",
        "actor.mb_spec.max_tokens_per_mb=256",
        "rollout.max_head_offpolicyness=2",
        "total_train_steps=3",
    ]
    preset = str(ROOT / "examples/math/gsm8k_grpo.yaml")
    cfg, _ = cli_args.load_expr_config(["--config", preset, *overrides], cli_args.GRPOConfig)
    train = get_custom_dataset("train", cfg.train_dataset, load_hf_tokenizer(cfg.tokenizer_path))
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        calls = []
        compute_logp = trainer.actor.compute_logp
        trainer.actor.compute_logp = lambda *a, **k: calls.append(1) or compute_logp(*a, **k)
        trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow",
            workflow_kwargs=dict(
                reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
                gconfig=cfg.gconfig,
                tokenizer=cfg.tokenizer_path,
            ),
        )
        rows = trainer.stats_logger.history
    assert calls == []
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    assert max(r["staleness/max"] for r in rows) >= 1  # stale tokens were interpolated
    for r in rows:
        assert r["update_successful"] == 1.0
        w = r["ppo_actor/update/compute_logp/loglinear/importance_weight/avg"]
        assert 0.9 < w < 1.1


def test_no_eos_ratio_reads_the_rollouts_flag_not_the_padded_width():
    """Two of four rows are as long as the padded batch, but only one hit the length limit:
    the stat is the rollout's ``no_eos`` (1/4), not "as long as the longest row" (2/4)."""
    stats_tracker.export()
    data = make_batch(bs=4)  # lengths 7, 5, 6, 4 in a width of 7
    data["attention_mask"][2, :] = 1  # row 2 now also spans the padded width
    data["no_eos"] = torch.tensor([False, False, True, False])
    actor = PPOActor(cfg(), TinyEngine())
    data["logprobs"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    actor.ppo_update(data)
    out = stats_tracker.export()
    assert out["ppo_actor/no_eos_ratio/avg"] == 0.25
    del data["no_eos"]  # a workflow without the flag: AReaL's rule, the padded width
    data["logprobs"] = actor.compute_logp(data)
    actor.compute_advantages(data)
    actor.ppo_update(data)
    assert stats_tracker.export()["ppo_actor/no_eos_ratio/avg"] == 0.5
