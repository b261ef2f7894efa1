"""Pipeline stages of the dense Archon models (torch.distributed.pipelining on gloo)."""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import run_ranks

from areal.models.archon.pipeline import DenseStage, build_schedule, stage_layer_ranges
from areal.models.archon.qwen2.args import Qwen2ModelArgs
from areal.models.archon.qwen2.model import Qwen2Model

ARGS = dict(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
    vocab_size=64, norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
M, L = 4, 12  # micro-batches (one padded sequence each), sequence length


def _model(tie=False):
    torch.manual_seed(0)
    return Qwen2Model(Qwen2ModelArgs(**ARGS, tie_word_embeddings=tie)).float()


def _data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS["vocab_size"], (M, L), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _reference(model, tokens, target):
    """One-rank run: the mean of the micro-batch losses (the schedule scales grads by 1/M)."""
    losses = []
    for i in range(M):
        pos = torch.arange(L)
        cu = torch.tensor([0, L], dtype=torch.int32)
        losses.append(_loss(model(tokens[i], pos, cu)[None], target[i : i + 1]))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach()


def _pp_rank(rank, world, schedule):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tokens, target = _data()
    ref = _model()
    ref_loss = _reference(ref, tokens, target)
    model = _model()
    v = 2 if schedule == "Interleaved1F1B" else 1
    mods = [DenseStage(model, rank + k * world, world * v) for k in range(v)]
    stage = torch.nn.ModuleList(mods)
    sched = build_schedule(mods if v > 1 else mods[0], dist.group.WORLD, M, _loss, schedule)
    losses = []
    if rank == 0:
        sched.step(tokens)
    else:
        sched.step(target=target, losses=losses)
    loss = torch.stack(losses).mean() if losses else torch.zeros(())
    dist.broadcast(loss, src=world - 1)
    ref_grads = dict(ref.named_parameters())
    named = {n: p for m in mods for n, p in m.named_parameters()}
    grads = {n: p.grad for n, p in named.items()}
    ref_g = {n: ref_grads[n].grad for n in grads}
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    opt.step()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    ref_w = {n: ref_grads[n].detach() for n in grads}
    return {
        "loss": loss, "ref_loss": ref_loss, "grads": grads, "ref_grads": ref_g,
        "weights": {n: p.detach() for n, p in named.items()}, "ref_weights": ref_w,
    }  # fmt: skip


def test_stage_layer_ranges_contiguous_cover_all_layers():
    rs = stage_layer_ranges(5, 2)
    assert [list(r) for r in rs] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="pp stages=5"):
        stage_layer_ranges(4, 5)


def test_stage_tied_embeddings_pp2_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings=True is not supported"):
        DenseStage(_model(tie=True), 0, 2)


def test_schedule_zero_bubble_refused_by_name():
    with pytest.raises(ValueError, match="'ZBVZeroBubble': not supported"):
        build_schedule(DenseStage(_model(), 0, 1), None, M, _loss, "ZBVZeroBubble")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_pp2_qwen2_one_step_equals_one_rank(schedule):
    res = run_ranks(_pp_rank, 2, (schedule,), timeout=300)
    owned = set()
    for r in (0, 1):
        got = res[r]
        torch.testing.assert_close(got["loss"], got["ref_loss"], atol=1e-5, rtol=0)
        assert got["grads"].keys() and got["grads"].keys().isdisjoint(owned)
        owned |= got["grads"].keys()
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, got["ref_grads"][n], atol=1e-5, rtol=0, msg=n)
            torch.testing.assert_close(
                got["weights"][n], got["ref_weights"][n], atol=1e-5, rtol=0, msg=n
            )
    assert owned == {n for n, _ in _model().named_parameters()}
