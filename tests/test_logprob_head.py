"""The fused log-probability head against autograd over linear -> log_softmax -> gather."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal.engine.fsdp.logprob_head import ChunkedLogprobHead, chunked_logprobs_entropy


def _reference(hidden, weight, bias, labels, temperature):
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [7, 1024])
def test_chunked_logprobs_entropy_values_and_grads_equal_autograd_reference(
    bias, temperature, chunk
):
    torch.manual_seed(0)
    n, h, v = 23, 16, 50
    hidden = torch.randn(n, h, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(v, h).requires_grad_()
    b = torch.randn(v).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,))
    g = torch.randn(n)

    logp, ent = chunked_logprobs_entropy(hidden, weight, b, labels, temperature, chunk)
    (logp * g).sum().backward()
    got = [hidden.grad.clone(), weight.grad.clone()] + ([b.grad.clone()] if bias else [])
    for p in [hidden, weight] + ([b] if bias else []):
        p.grad = None

    ref_logp, ref_ent = _reference(hidden, weight, b, labels, temperature)
    (ref_logp * g).sum().backward()
    want = [hidden.grad, weight.grad] + ([b.grad] if bias else [])

    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    # lse - sum(p z): fp32 cancellation of ~1e-5 where the entropy is near 0
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    assert not ent.requires_grad
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


def test_chunked_logprobs_bf16_hidden_gets_bf16_grad_from_fp32_logits():
    torch.manual_seed(1)
    hidden = torch.randn(9, 8).bfloat16().requires_grad_()
    weight = torch.randn(30, 8).bfloat16().requires_grad_()
    labels = torch.randint(0, 30, (9,))
    logp, _ = chunked_logprobs_entropy(hidden, weight, None, labels, 1.0, 4)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    ref, _ = _reference(hidden.detach(), weight.detach(), None, labels, 1.0)
    torch.testing.assert_close(logp.detach(), ref, atol=1e-5, rtol=1e-5)


def test_head_with_rows_scores_each_label_from_its_row():
    torch.manual_seed(2)
    lin = torch.nn.Linear(8, 20, bias=False)
    head = ChunkedLogprobHead(lin, chunk_size=4)
    hidden = torch.randn(1, 6, 8)
    rows = torch.tensor([0, 0, 3, 5])
    labels = torch.tensor([1, 2, 3, 4])
    head.request(labels, 1.0, rows=rows)
    out = head(hidden)
    head.request(None)
    ref, ref_ent = _reference(hidden[0, rows], lin.weight, None, labels, 1.0)
    torch.testing.assert_close(out[0, :, 0], ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0, :, 1], ref_ent, atol=1e-4, rtol=1e-4)
    # without a request it is the plain linear layer
    torch.testing.assert_close(head(hidden), lin(hidden))
