"""``areal.engine.fsdp.attention.varlen_sdpa_attention``: packed attention equals per-sequence SDPA.

Three paths: one padded batched SDPA (lengths even enough), a split loop (lengths too
uneven for padding), one sequence. Values and gradients must match causal SDPA run on
each sequence alone, and nothing may leak across sequence boundaries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from areal.engine.fsdp import attention as fsdp


class _Attn(nn.Module):
    num_key_value_groups = 2  # 4 query heads, 2 KV heads (GQA)


def _qkv(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, n, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, n, 8, generator=g, requires_grad=True)
    return q, k, v


def _cu(lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu


def _reference(q, k, v, lens):
    outs, s = [], 0
    for n in lens:
        o = F.scaled_dot_product_attention(
            q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n],
            is_causal=n > 1, enable_gqa=True,
        )  # fmt: skip
        outs.append(o)
        s += n
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize(
    "lens",
    [
        [7, 5, 9, 6],  # even lengths: one padded SDPA
        [1, 40, 2, 3],  # very uneven: per-sequence split loop
        [13],  # one sequence
        [1, 1, 1],  # single-token sequences
    ],
)
def test_varlen_sdpa_attention_packed_equals_per_sequence_values_and_grads(lens):
    q, k, v = _qkv(lens)
    cu = _cu(lens)
    out, _ = fsdp.varlen_sdpa_attention(_Attn(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    ref = _reference(q, k, v, lens)
    assert out.shape == (1, sum(lens), 4, 8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ref)
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_varlen_sdpa_attention_padded_path_taken_and_no_leak_across_sequences():
    lens = [6, 6, 5]
    assert len(lens) * max(lens) ** 2 <= fsdp.PADDED_ATTN_MAX_WASTE * sum(n * n for n in lens)
    q, k, v = _qkv(lens, seed=1)
    cu = _cu(lens)
    out, _ = fsdp.varlen_sdpa_attention(_Attn(), q, k, v, None, cu_seq_lens_q=cu)
    # changing the second sequence's keys/values leaves the first and third untouched
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 6:12] += 5.0
    v2[:, :, 6:12] -= 3.0
    out2, _ = fsdp.varlen_sdpa_attention(_Attn(), q, k2, v2, None, cu_seq_lens_q=cu)
    torch.testing.assert_close(out2[:, :6], out[:, :6])
    torch.testing.assert_close(out2[:, 12:], out[:, 12:])
    assert not torch.allclose(out2[:, 6:12], out[:, 6:12])


# ------------------------------------------------------------------ shared prefixes
def _grouped_ids(seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Packed ids: two prompts x 3 samples (sharing 9 and 6 leading tokens; two samples of
    the first also share their first 2 generated tokens), one unrelated sequence, and a
    sample that is itself a prefix of another."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(10, 300, (n,), generator=g)  # noqa: E731
    p1, p2, c = r(9), r(6), r(2)
    seqs = [
        torch.cat([p1, c, r(4)]),
        torch.cat([p2, r(7)]),
        torch.cat([p1, r(3)]),
        r(12),
        torch.cat([p2, r(2)]),
        torch.cat([p1, c, r(6)]),
        torch.cat([p2, r(9)]),
    ]
    seqs.append(seqs[-1][:11].clone())  # a prefix of another sample
    return torch.cat(seqs), [len(s) for s in seqs]


def test_plan_shared_prefixes_groups_by_leading_tokens_each_member_keeps_own_token():
    ids, lens = _grouped_ids()
    cu = _cu(lens)
    plan = fsdp.plan_shared_prefixes(ids, cu, min_shared=4, min_saving=0.0)
    assert plan is not None
    # every original token maps to a compressed row holding the same token
    torch.testing.assert_close(ids.index_select(0, plan.src)[plan.back], ids)
    # shared: p1 + c (11) once for two members, p1 (9) ... fewer rows than tokens
    assert plan.n_tokens < ids.numel() - 2 * 9
    # a member that is a prefix of another keeps its last token as its own row
    last = plan.back[cu[-2] : cu[-1]]
    assert last[-1] not in set(plan.back[cu[-3] : cu[-2]].tolist())
    # nothing shared -> no plan
    assert fsdp.plan_shared_prefixes(torch.arange(20), _cu([10, 10])) is None


def _pair_ids(seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """DPO-like pairs whose prompts spread from 8 to 60 tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for p in (8, 9, 30, 60):
        prompt = torch.randint(0, 50, (p,), generator=g)
        seqs += [torch.cat([prompt, torch.randint(50, 99, (r,), generator=g)]) for r in (3, 7)]
    return torch.cat(seqs), [len(s) for s in seqs]


@pytest.mark.parametrize("make", [_grouped_ids, _pair_ids])
def test_varlen_sdpa_attention_shared_prefix_plan_equals_per_sequence_values_and_grads(make):
    ids, lens = make(seed=3)
    cu = _cu(lens)
    plan = fsdp.plan_shared_prefixes(ids, cu, min_shared=4, min_saving=0.0)
    # members of different own lengths: several padded attention calls (length buckets)
    assert len(plan.member_rows) > 1
    if make is _pair_ids:  # prompts of 8-9, 30 and 60 tokens: a padded call each
        assert [tuple(r.shape) for r in plan.prefix_rows] == [(1, 60), (1, 30), (2, 9)]
        # members split by the prefix they attend to, too: keys of 60 never pad one of 9
        pairs = zip(plan.member_rows, plan.member_keys, strict=True)
        assert {int(k.shape[1] - r.shape[1]) for r, k in pairs} == {60, 30, 9}
    qc, kc, vc = _qkv([plan.n_tokens], seed=4)
    out, _ = fsdp.varlen_sdpa_attention(
        _Attn(), qc, kc, vc, None, cu_seq_lens_q=torch.tensor(plan.seg_cu),
        shared_prefix_plan=plan,
    )  # fmt: skip
    # reference: every sequence on its own, with the shared rows' q/k/v copied to it
    expand = lambda x: x.index_select(2, plan.back)  # noqa: E731
    ref = _reference(expand(qc), expand(kc), expand(vc), lens)
    got = out.index_select(1, plan.back)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ref)
    g_out = torch.autograd.grad((got * w).sum(), (qc, kc, vc))
    g_ref = torch.autograd.grad((ref * w).sum(), (qc, kc, vc))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
