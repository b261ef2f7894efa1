"""``areal.utils.fsdp.varlen_sdpa_attention``: packed attention equals per-sequence SDPA.

Three paths: one padded batched SDPA (lengths even enough), a split loop (lengths too
uneven for padding), one sequence. Values and gradients must match causal SDPA run on
each sequence alone, and nothing may leak across sequence boundaries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from areal.utils import fsdp


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
