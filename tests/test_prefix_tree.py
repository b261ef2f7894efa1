"""Prefix-trie packing (areal.utils.prefix_tree): the trie invariants (property tests)
and tree-forward log-probabilities / gradients equal to the flat per-sequence forward on
the shipped tiny Qwen2 (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.utils.prefix_tree import pack_prefix_trees, tree_forward_logprobs

VOCAB = 384


def _distinct_prefixes(seqs: list[list[int]]) -> int:
    return len({tuple(s[: k + 1]) for s in seqs for k in range(len(s))})


_seqs = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None)
@given(_seqs, st.one_of(st.none(), st.integers(12, 40)))
def test_pack_prefix_trees_random_seqs_recoverable_shared_once_budget_kept(seqs, budget):
    packs = pack_prefix_trees(seqs, max_tokens=budget)
    seen = sorted(s for p in packs for s in p.seq_ids)
    assert seen == list(range(len(seqs)))
    for pack in packs:
        if budget is not None:
            assert pack.n_tokens <= budget
        members = [seqs[s] for s in pack.seq_ids]
        # each shared prefix stored once per trie: nodes == distinct prefixes per trie
        per_tree: dict[int, list[list[int]]] = {}
        for t, s in zip(pack.tree_of, pack.seq_ids):
            per_tree.setdefault(t, []).append(seqs[s])
        assert pack.n_tokens == sum(_distinct_prefixes(v) for v in per_tree.values())
        if budget is None:
            assert pack.n_tokens == _distinct_prefixes(members)
        for s, idx in zip(pack.seq_ids, pack.seq_index):
            assert pack.input_ids[idx].tolist() == seqs[s]
            assert pack.position_ids[idx].tolist() == list(range(len(seqs[s])))
            # the last token of a sequence attends exactly to the sequence's tokens
            row = pack.attention_mask[idx[-1]]
            assert sorted(row.nonzero()[:, 0].tolist()) == sorted(idx.tolist())
            assert pack.parent[idx[0]] == -1
            assert pack.parent[idx[1:]].tolist() == idx[:-1].tolist()


def test_pack_prefix_trees_bad_input_clear_error():
    with pytest.raises(ValueError, match="max_tokens=4"):
        pack_prefix_trees([[1, 2, 3, 4, 5]], max_tokens=4)
    with pytest.raises(ValueError, match=r"seqs\[1\] is empty"):
        pack_prefix_trees([[1], []])
    with pytest.raises(ValueError, match="max_tokens=0"):
        pack_prefix_trees([[1]], max_tokens=0)


def test_pack_prefix_trees_linear_chain_contiguous():
    (pack,) = pack_prefix_trees([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]])
    assert pack.n_tokens == 6
    assert pack.seq_index[1].tolist() == list(range(6))


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    from areal.models.tiny import get_tiny_base_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        get_tiny_base_path(), attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _grpo(rng):
    out = []
    for _ in range(2):
        prompt = _rand(rng, rng.randint(3, 20))
        out += [prompt + _rand(rng, rng.randint(1, 12)) for _ in range(4)]
    return out


def _agent(rng):
    out = []
    for _ in range(2):
        hist = _rand(rng, rng.randint(4, 10))
        for _ in range(rng.randint(3, 6)):
            hist = hist + _rand(rng, rng.randint(2, 8))
            out.append(list(hist))
    return out


def _dpo(rng):
    out = []
    for _ in range(3):
        prompt = _rand(rng, rng.randint(4, 16))
        out += [prompt + _rand(rng, rng.randint(1, 10)), prompt + _rand(rng, rng.randint(1, 10))]
    return out


def _flat(model, seqs):
    res = []
    for s in seqs:
        logp = model(input_ids=torch.tensor([s])).logits[0].float().log_softmax(-1)
        res.append(logp[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return res


@pytest.mark.slow
@pytest.mark.parametrize("workload", [_grpo, _agent, _dpo])
@pytest.mark.parametrize("budget", [None, 48])
def test_tree_forward_logprobs_workloads_equal_flat_path(tiny, workload, budget):
    rng = random.Random(hash((workload.__name__, budget)) % 1000)
    seqs = workload(rng)
    with torch.no_grad():
        tree = tree_forward_logprobs(tiny, seqs, max_tokens=budget)
        flat = _flat(tiny, seqs)
    assert sum(p.n_tokens for p in pack_prefix_trees(seqs)) < sum(map(len, seqs))
    for t, f in zip(tree, flat, strict=True):
        torch.testing.assert_close(t, f, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tree_forward_logprobs_loss_gradients_equal_flat_path(tiny):
    seqs = _agent(random.Random(3)) + _dpo(random.Random(4))
    weights = [1.0 + 0.1 * k for k in range(len(seqs))]

    def grads(fn):
        tiny.zero_grad()
        loss = sum(w * lp.sum() for w, lp in zip(weights, fn(tiny, seqs)))
        loss.backward()
        return {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}

    tree = grads(tree_forward_logprobs)
    flat = grads(_flat)
    assert tree.keys() == flat.keys()
    for name in flat:
        # sums over ~200 tokens: compare relative to the gradient's size
        err = (tree[name] - flat[name]).abs().max() / flat[name].abs().max().clamp_min(1e-12)
        assert err < 1e-5, (name, float(err))


def test_fsdp_engine_tree_training_enabled_refused():
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.fsdp.engine import FSDPEngine

    cfg = TrainEngineConfig(experiment_name="e", trial_name="t", path="unused")
    cfg.enable_tree_training = True
    with pytest.raises(NotImplementedError, match="enable_tree_training=True"):
        FSDPEngine(cfg)
