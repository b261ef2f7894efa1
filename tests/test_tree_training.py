"""Tree training (``enable_tree_training``): prefix tries of any depth, exact against the
flat packed path (fp32, atol 1e-5): logprobs, the PPO/SFT/DPO losses and the gradients,
on GRPO groups, multi-call agent exports and DPO pairs; property tests of the trie."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.engine.fsdp.tree_attention import plan_tree
from areal.utils.prefix_trie import pack_tries, padded_rows, trie_nodes, trie_size

ATOL = 1e-5


def _cu(lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu


def _rows(g: torch.Generator, n: int, vocab: int = 300) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=g)


def grpo_rows(seed: int, groups: int = 3, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        prompt = _rows(g, int(torch.randint(4, 30, (1,), generator=g)))
        for _ in range(n):
            out.append(torch.cat([prompt, _rows(g, int(torch.randint(1, 20, (1,), generator=g)))]))
    return out


def agent_rows(seed: int, episodes: int = 2) -> list[torch.Tensor]:
    """One row per model call: the whole history so far, then the new completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(episodes):
        hist = _rows(g, int(torch.randint(5, 25, (1,), generator=g)))
        for _ in range(int(torch.randint(3, 7, (1,), generator=g))):
            row = torch.cat([hist, _rows(g, int(torch.randint(2, 12, (1,), generator=g)))])
            out.append(row)
            hist = torch.cat([row, _rows(g, int(torch.randint(1, 6, (1,), generator=g)))])
    return out


def dpo_rows(seed: int, pairs: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pairs):
        prompt = _rows(g, int(torch.randint(3, 30, (1,), generator=g)))
        for _ in range(2):
            out.append(torch.cat([prompt, _rows(g, int(torch.randint(1, 15, (1,), generator=g)))]))
    return out


def padded_batch(rows: list[torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    b, t = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = True
    loss_mask = mask & (torch.rand(b, t, generator=g) < 0.8)
    loss_mask[:, 0] = False
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "old_logp": -torch.rand(b, t, generator=g) * 5 * mask,
        "advantages": torch.randn(b, t, generator=g) * mask,
        "ref_logp": -torch.rand(b, t, generator=g) * 5 * mask,
    }


# ----------------------------------------------------------------------------- trie
def _distinct_prefixes(seqs: list[list[int]]) -> int:
    return len({tuple(s[: k + 1]) for s in seqs for k in range(len(s))})


seq_lists = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=10
).map(lambda xs: xs + [xs[0] + [1, 2]] if len(xs) > 1 else xs)


@settings(max_examples=60, deadline=None)
@given(seq_lists)
def test_trie_nodes_random_sequences_recoverable_and_each_shared_token_stored_once(seqs):
    ids = torch.tensor([t for s in seqs for t in s])
    cu = _cu([len(s) for s in seqs])
    trie = trie_nodes(ids, cu)
    # every sequence recoverable from the stored tokens
    assert torch.equal(ids.index_select(0, trie.src)[trie.node], ids)
    # one stored token per distinct prefix: shared tokens once, nothing else merged
    assert trie.n_nodes == _distinct_prefixes(seqs) == trie_size(ids, cu)
    # storage order is topological: a token's parent is stored before it
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        nodes = trie.node[a:b]
        assert bool((nodes[1:] > nodes[:-1]).all()), s


@settings(max_examples=60, deadline=None)
@given(seq_lists, st.integers(12, 40), st.sampled_from([1, 2]))
def test_pack_tries_random_sequences_keep_budget_and_count_stored_tokens(seqs, cap, gran):
    if len(seqs) % gran:
        seqs = seqs + [seqs[-1]]
    ids = torch.tensor([t for s in seqs for t in s])
    cu = _cu([len(s) for s in seqs])
    pad, lens = padded_rows(ids, cu)
    biggest = max(_distinct_prefixes(seqs[i : i + gran]) for i in range(0, len(seqs), gran))
    if biggest > cap:  # one item alone over the budget: refused by name
        with pytest.raises(ValueError, match="max_tokens_per_mb"):
            pack_tries(pad, lens, cap, gran)
        return
    bins, loads = pack_tries(pad, lens, cap, gran)
    items = sorted(i for b in bins for i in b)
    assert items == list(range(len(seqs) // gran))  # every item packed exactly once
    for b, load in zip(bins, loads, strict=True):
        rows = [seqs[i * gran + j] for i in b for j in range(gran)]
        assert load == _distinct_prefixes(rows) <= cap


def test_pack_tries_item_over_budget_raises_naming_the_field():
    pad, lens = padded_rows(torch.arange(10), _cu([10]))
    with pytest.raises(ValueError, match="max_tokens_per_mb=8"):
        pack_tries(pad, lens, 8)


def test_plan_tree_training_runs_one_level_sharing_on_the_one_level_kernels():
    from areal.engine.fsdp.attention import SharedPrefixPlan, plan_tree_training
    from areal.engine.fsdp.tree_attention import TreePlan

    def plan(rows, **kw):
        return plan_tree_training(torch.cat(rows), _cu([len(r) for r in rows]), **kw)

    g = torch.Generator().manual_seed(5)
    prompts = [_rows(g, n) for n in (12, 20, 40)]
    # GRPO groups / DPO pairs with prompts of >= 8 tokens: the trie is one level deep
    groups = [torch.cat([p, torch.tensor([i]), _rows(g, 5)]) for p in prompts for i in range(4)]
    one = plan(groups)
    n_trie = trie_size(torch.cat(groups), _cu([len(r) for r in groups]))
    assert isinstance(one, SharedPrefixPlan) and n_trie <= one.n_tokens <= n_trie / 0.95
    # agent exports share histories at many depths: the trie
    agent = agent_rows(2)
    assert isinstance(plan(agent), TreePlan)
    # padding to the budget (pad_to_maximum) is the trie's; a budget the one-level
    # layout would overrun (it shares no prompt under 8 tokens) keeps the trie as well
    assert isinstance(plan(groups, pad_to=400), TreePlan)
    short = [torch.cat([p[:5], _rows(g, 6)]) for p in prompts for _ in range(3)] + groups[:4]
    n_trie = trie_size(torch.cat(short), _cu([len(r) for r in short]))
    assert isinstance(plan(short, budget=n_trie), TreePlan)
    # nothing shared: the flat layout
    assert plan([torch.arange(10), torch.arange(10, 20)]) is None


# ------------------------------------------------------------------- attention
def _reference_attention(q, k, v, lens):
    outs = []
    for qs, ks, vs in zip(*(t.split(lens, dim=2) for t in (q, k, v)), strict=True):
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


@pytest.mark.parametrize("make", [grpo_rows, agent_rows, dpo_rows])
def test_tree_attention_equals_per_sequence_causal_values_and_grads(make):
    from areal.engine.fsdp.tree_attention import tree_attention

    rows = make(7)
    ids = torch.cat(rows)
    lens = [len(r) for r in rows]
    plan = plan_tree(ids, _cu(lens), pad_to=0)
    assert plan is not None and plan.n_stored < ids.numel()
    g = torch.Generator().manual_seed(1)
    # one q/k/v per stored token (a model gives a shared token the same activations in
    # every sequence); the reference sees each sequence's full copy
    stored = [torch.randn(1, 2, plan.n_tokens, 8, generator=g) for _ in range(3)]
    leaves = [t.clone().requires_grad_(True) for t in stored]
    ref = _reference_attention(*(t.index_select(2, plan.back) for t in leaves), lens)
    w = torch.randn(ref.shape, generator=g)
    (ref * w).sum().backward()
    tleaves = [t.clone().requires_grad_(True) for t in stored]
    out = tree_attention(plan, *tleaves, 0.0, None, False)[0].index_select(0, plan.back)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    (out * w).sum().backward()
    for a, b in zip(leaves, tleaves, strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- engine
def _engine_session(rank, world, path):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine
    from areal.trainer.dpo.dpo_engine import compute_dpo_loss, dpo_loss_weight
    from areal.trainer.ppo.actor import grpo_loss_fn, loss_weight
    from areal.trainer.sft.lm_engine import sft_loss_fn, sft_loss_weight_fn
    from areal.utils.data import unpack_sequence

    torch.set_num_threads(1)
    cfg = TrainEngineConfig(
        experiment_name="t", trial_name="t", path=path, dtype="float32", num_threads=1,
        optimizer=OptimizerConfig(lr=1e-3), mb_spec=MicroBatchSpec(max_tokens_per_mb=120),
    )  # fmt: skip
    eng = FSDPEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    losses = {
        "grpo": (functools.partial(grpo_loss_fn, eps_clip=0.2), loss_weight),
        "sft": (sft_loss_fn, sft_loss_weight_fn),
        "dpo": (functools.partial(compute_dpo_loss, beta=0.1), dpo_loss_weight),
    }
    workloads = {
        "grpo": (grpo_rows(1), ["grpo", "sft"], 1),
        "agent": (agent_rows(2), ["grpo", "sft"], 1),
        "dpo": (dpo_rows(3), ["dpo", "sft"], 2),
    }
    res = {}
    for wname, (rows, names, gran) in workloads.items():
        batch = padded_batch(rows)
        cfg.mb_spec.granularity = gran
        for tree in (False, True):
            cfg.enable_tree_training = tree
            eng.share_prefixes = False  # the flat packed path as the reference
            out = {"logp": eng.forward_batch(batch)}
            mbl = eng._split(batch)
            mbs = list(mbl.packed())
            out["n_mbs"] = len(mbs)
            plans = [eng._shared_prefix_plan(mb["input_ids"], mb["cu_seqlens"]) for mb in mbs]
            out["stored"] = sum(
                int(mb["input_ids"].numel()) if p is None else p.n_tokens
                for p, mb in zip(plans, mbs, strict=True)
            )
            out["tokens"] = int(batch["attention_mask"].sum())
            for lname in names:
                fn, wfn = losses[lname]
                eng.optimizer_zero_grad()
                w = torch.stack([torch.as_tensor(wfn(mb), dtype=torch.float64) for mb in mbs])
                total, ents = torch.zeros((), dtype=torch.float64), []
                for mb, wi in zip(mbs, w, strict=True):
                    lp, ent = eng._forward_packed(mb)
                    loss = fn(lp, ent, mb) * float(wi / w.sum())
                    loss.backward()
                    total += loss.detach().double()
                    ents.extend(unpack_sequence(ent.detach(), mb["cu_seqlens"]))
                grads = [p.grad.full_tensor().clone() for p in eng.model.parameters()]
                out[lname] = (total, grads)
                out["ent"] = [ents[i] for i in mbl.backward_indices.tolist()]
            res[(wname, tree)] = out
    eng.destroy()
    return res


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    from _dist_helpers import run_ranks
    from conftest import build_tiny_qwen2

    path = build_tiny_qwen2(str(tmp_path_factory.mktemp("tree") / "m"))
    return run_ranks(_engine_session, 1, (path,), timeout=300)[0]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["grpo", "agent", "dpo"])
def test_fsdp_tree_training_random_batches_equal_flat_logprobs_losses_grads(
    engine_results, workload
):
    flat, tree = engine_results[(workload, False)], engine_results[(workload, True)]
    torch.testing.assert_close(tree["logp"], flat["logp"], atol=ATOL, rtol=0)
    for a, b in zip(tree["ent"], flat["ent"], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    names = [k for k in flat if k in ("grpo", "sft", "dpo")]
    assert names
    for name in names:
        torch.testing.assert_close(tree[name][0], flat[name][0], atol=ATOL, rtol=0)
        for ga, gb in zip(tree[name][1], flat[name][1], strict=True):
            torch.testing.assert_close(ga, gb, atol=ATOL, rtol=0)
    # the budget counts stored trie tokens: shared histories fit more rows per micro-batch
    assert tree["n_mbs"] <= flat["n_mbs"]
    # the tree path ran: fewer stored rows than tokens (the flat path stores them all)
    assert flat["stored"] == flat["tokens"] > tree["stored"]
