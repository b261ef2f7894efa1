"""The qwen3_moe archon family against transformers (one process): packed logits equal
Qwen3MoeForCausalLM's per sequence (fp32, atol 1e-5), with a dense mlp_only layer and
with and without norm_topk_prob; the load-balancing loss equals transformers'; the
adapter round-trips both HF expert layouts (per-expert on disk, fused in memory);
replaying the recorded routing reproduces the logits; ep not dividing the experts is
refused by name."""

from __future__ import annotations

import pytest
import torch

ATOL = 1e-5
VOCAB = 96


def hf_moe(
    seed: int = 0,
    norm_topk_prob: bool = True,
    mlp_only_layers=(),
    n_experts: int = 4,
    vocab: int = VOCAB,
):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=n_experts,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # away from the near-identity default init (router too)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def archon_of(hf):
    from areal.models.archon import get_model_spec

    spec = get_model_spec(hf.config.model_type)
    args = spec.model_args_class.from_hf_config(hf.config)
    model = spec.model_class(args)
    adapter = spec.state_dict_adapter_class(args)
    model.load_state_dict(adapter.from_hf(hf.state_dict()), strict=True)
    return model.eval(), adapter


def packed(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return seqs, torch.cat(seqs), pos, cu


@pytest.mark.parametrize(
    "norm,mlp_only", [(True, ()), (False, (1,))], ids=["norm", "nonorm-dense1"]
)
def test_qwen3_moe_logits_equal_transformers(norm, mlp_only):
    hf = hf_moe(norm_topk_prob=norm, mlp_only_layers=mlp_only)
    ours, _ = archon_of(hf)
    seqs, tokens, pos, cu = packed([7, 13, 1, 20])
    with torch.no_grad():
        got = ours(tokens, pos, cu)
        want = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert len(ours.moe_modules()) == 2 - len(mlp_only)


def test_aux_loss_equals_transformers_and_replay_reproduces_logits():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = hf_moe()
    ours, _ = archon_of(hf)
    seqs, tokens, pos, cu = packed([20])
    with torch.no_grad():
        got = ours(tokens, pos, cu)
        aux = ours.aux_loss()
        routed = ours.routed_experts()
        out = hf(input_ids=tokens[None], output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, 4, 2)
    torch.testing.assert_close(aux, want, atol=1e-6, rtol=0)
    assert routed.shape == (20, 2, 2)
    with torch.no_grad():  # replaying its own routing is the same forward
        torch.testing.assert_close(
            ours(tokens, pos, cu, routed_experts=routed), got, atol=0, rtol=0
        )
        other = torch.roll(routed, shifts=1, dims=0)  # another routing: other logits
        assert (ours(tokens, pos, cu, routed_experts=other) - got).abs().max() > 1e-3


def test_adapter_reads_both_hf_expert_layouts_and_writes_disk_names(tmp_path):
    from safetensors.torch import load_file

    hf = hf_moe()
    ours, adapter = archon_of(hf)
    hf.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in disk
    from_disk = adapter.from_hf(disk)
    for k, v in ours.state_dict().items():
        assert torch.equal(from_disk[k], v), k
    back = adapter.to_hf(ours.state_dict())
    assert set(back) == set(disk)
    for k, v in disk.items():
        assert torch.equal(back[k], v), k
    fused = adapter.to_hf(ours.state_dict(), fused=True)
    for k, v in hf.state_dict().items():
        assert torch.equal(fused[k], v), k


def test_ep_not_dividing_experts_is_refused_by_name():
    from areal.models.archon import check_layout

    hf = hf_moe(n_experts=6)
    with pytest.raises(
        ValueError, match=r"expert parallel e4 does not divide the 6 experts.*\[1, 2, 3, 6\]"
    ):
        check_layout(hf.config, ep=4)
    check_layout(hf.config, ep=3)


def test_ep_not_dividing_dp_is_refused_at_parse_time():
    from areal.api.alloc_mode import AllocationMode

    with pytest.raises(
        ValueError, match=r"e4 must divide data parallelism d2.*allowed e: \[1, 2\]"
    ):
        AllocationMode.from_str("local:d1+archon:d2e4")
    assert AllocationMode.from_str("local:d1+archon:d4e2").train.ep_size == 2


@pytest.mark.parametrize("mlp_only", [(), (1,)], ids=["all-moe", "dense-layer1"])
def test_moe_stages_carry_the_aux_loss_and_replay_as_the_whole_model(mlp_only):
    # pipeline stages of a qwen3_moe model, run one after the other in one process: the
    # last stage's logits and load-balancing loss (sums carried in the activation's extra
    # rows, padding tokens not counted) equal the whole model's, gradients included, and
    # each stage replays its own layers' slice of the routing
    from areal.models.archon.pipeline import MoEStage, make_stage

    model, _ = archon_of(hf_moe(mlp_only_layers=mlp_only, n_experts=8))
    _, ids, pos, cu = packed([7, 5])
    n, pad = ids.shape[0], 3
    routed = torch.stack([torch.randperm(8)[:2] for _ in range(n * model.args.n_layers)])
    routed = routed.view(n, -1, 2)[:, : len(model.moe_modules())]
    for replay in (None, routed):
        model.zero_grad()
        want = model(ids, pos, cu, routed_experts=replay)
        want_aux = model.aux_loss()
        (want.logsumexp(-1).mean() + want_aux).backward()
        want_g = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        ranges = [range(0), range(1), range(1, 2)]  # the first stage: the embedding only
        stages = [make_stage(model, s, 3, r) for s, r in enumerate(ranges)]
        assert all(isinstance(st, MoEStage) for st in stages)
        x = torch.cat([ids, torch.zeros(pad, dtype=torch.long)])[None]
        full_pos = torch.cat([pos, torch.arange(pad)])
        full_cu = torch.cat([cu, torch.tensor([n + pad])]).int()
        rt = None if replay is None else torch.cat([replay, replay[:pad]])
        for st in stages:
            st.carry_aux = True
            st.set_micro_batches([(full_pos, full_cu, n, rt)])
            x = st(x)
            if not st.is_last:
                assert x.shape == (1, n + pad + 1, 32)  # 17 sums in one extra row
        got, aux = x[0, :n], stages[-1].pop_aux(0)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(aux, want_aux, atol=ATOL, rtol=0)
        (got.logsumexp(-1).mean() + aux).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_g[k], atol=ATOL, rtol=0, msg=k)
