"""The tiny MoE end to end on CPU: the package-data checkpoint (``tiny-moe``: tiny-base's
tokenizer, 4 experts, <= 5 MB) loads in the archon family with transformers' logits; the
built-in server's generation core serves it (prefill and decode) with greedy output equal
to transformers' ``generate`` and, on ``return_routed_experts``, the experts of every
token, which are the archon model's routing of the same tokens; replaying the rollout's
routing in the trainer's forward lowers the mean |trainer logprob - rollout logprob| of a
bf16 rollout (both figures printed). With ``rollout.return_routed_experts`` the routing
travels from a real built-in server through ``RemoteInfEngine`` and the RLVR workflow into
the training batch, where the Archon engine replays it."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from _hf_reference import hf_greedy, hf_logprobs, hf_model
from _local_engine import local_engine

from areal.inference.server.core import GenerationCore, SamplingParams
from areal.models.tiny_moe import get_tiny_moe_path

ATOL = 1e-5
REWARD = "areal.reward.gsm8k.gsm8k_reward_fn"


@pytest.fixture(scope="module")
def moe_dir():
    return get_tiny_moe_path()


def _archon(path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from areal.models.archon import get_model_spec

    hf = AutoConfig.from_pretrained(path)
    spec = get_model_spec(hf.model_type)
    args = spec.model_args_class.from_hf_config(hf)
    model = spec.model_class(args)
    adapter = spec.state_dict_adapter_class(args)
    model.load_state_dict(adapter.from_hf(load_file(os.path.join(path, "model.safetensors"))))
    return model.eval()


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(4, 384) for _ in range(rng.randrange(4, 20))] for _ in range(n)]


def _run(core, prompts, **sp):
    results: dict[int, dict] = {}
    done = threading.Event()

    def cb(i):
        def f(r):
            results[i] = r
            if len(results) == len(prompts):
                done.set()

        return f

    try:
        for i, p in enumerate(prompts):
            core.submit(str(i), p, SamplingParams(return_routed_experts=True, **sp), cb(i))
        assert done.wait(120)
    finally:
        core.shutdown()
    return [results[i] for i in range(len(prompts))]


def _forward(model, seq, routed=None):
    ids = torch.tensor(seq)
    pos = torch.arange(len(seq))
    cu = torch.tensor([0, len(seq)])
    with torch.no_grad():
        logits = model(ids, pos, cu, routed_experts=routed)
    return torch.log_softmax(logits.float(), -1), model.routed_experts()


def test_tiny_moe_asset_is_small_and_matches_transformers(moe_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(moe_dir)
    assert cfg.model_type == "qwen3_moe" and 4 <= cfg.num_experts <= 8
    assert os.path.getsize(os.path.join(moe_dir, "model.safetensors")) <= 5 * 2**20
    seq = _prompts(1, 3)[0]
    lp, _ = _forward(_archon(moe_dir), seq)
    with torch.no_grad():
        want = torch.log_softmax(hf_model(moe_dir)(torch.tensor([seq])).logits[0], -1)
    torch.testing.assert_close(lp, want, atol=ATOL, rtol=0)


def test_server_core_greedy_equals_generate_and_returns_routed_experts(moe_dir):
    torch.set_num_threads(1)
    ref = hf_model(moe_dir)
    prompts = _prompts(6, 1)
    res = _run(
        GenerationCore(hf_model(moe_dir), max_batch_size=4), prompts, max_new_tokens=10, greedy=True
    )
    ours = _archon(moe_dir)
    for p, r in zip(prompts, res):
        assert r["output_ids"] == hf_greedy(ref, p, 10)
        torch.testing.assert_close(
            torch.tensor(r["output_logprobs"]),
            hf_logprobs(ref, p, r["output_ids"]),
            atol=1e-4,
            rtol=0,
        )
        routed = torch.tensor(r["routed_experts"])
        seq = p + r["output_ids"]
        assert routed.shape == (len(seq) - 1, 4, 2)  # the last token is never fed
        _, want = _forward(ours, seq[:-1])
        assert torch.equal(routed.sort(-1).values, want.sort(-1).values.to(routed.dtype))


def test_routing_replay_lowers_trainer_rollout_logprob_mismatch(moe_dir):
    torch.set_num_threads(1)
    prompts = _prompts(8, 2)
    server = hf_model(moe_dir).to(torch.bfloat16)  # the rollout's numerics differ
    res = _run(
        GenerationCore(server, max_batch_size=8),
        prompts,
        max_new_tokens=24,
        temperature=1.0,
        seed=0,
    )
    trainer = _archon(moe_dir)
    gaps = {"without": [], "with": []}
    for p, r in zip(prompts, res):
        seq, out = p + r["output_ids"], r["output_ids"]
        routed = torch.tensor(r["routed_experts"])
        routed = torch.cat([routed, routed[-1:]])  # the last token's routing scores nothing
        rollout = torch.tensor(r["output_logprobs"])
        for key, rep in (("without", None), ("with", routed)):
            lp, _ = _forward(trainer, seq, rep)
            got = lp[len(p) - 1 : -1].gather(1, torch.tensor(out)[:, None])[:, 0]
            gaps[key].append((got - rollout).abs())
    without = torch.cat(gaps["without"]).mean().item()
    with_replay = torch.cat(gaps["with"]).mean().item()
    print(f"mean |trainer - rollout logprob|: without replay {without:.5f}, with {with_replay:.5f}")
    assert with_replay < without


def test_rollout_routed_experts_reach_the_batch_through_the_real_server(moe_dir):
    """Real server on 127.0.0.1 -> RemoteInfEngine -> RLVRWorkflow: the trajectory's
    ``routed_experts`` ``[1, L, n_moe_layers, top_k]`` is the archon model's routing of the
    same tokens, and the Archon engine's replay forward accepts the batch."""
    import asyncio

    from transformers import AutoTokenizer

    from areal.api.cli_args import GenerationHyperparameters
    from areal.workflow.rlvr import RLVRWorkflow

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(moe_dir)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=12, greedy=True)
    wf = RLVRWorkflow(reward_fn=REWARD, gconfig=gconfig, tokenizer=tok)
    data = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"}
    with local_engine(moe_dir, return_routed_experts=True) as eng:
        traj = asyncio.run(wf.arun_episode(eng, data))
    seq = traj["input_ids"][0].tolist()
    routed = traj["routed_experts"]
    assert routed.dtype == torch.int32 and routed.shape == (1, len(seq), 4, 2)
    _, want = _forward(_archon(moe_dir), seq[:-1])
    got = routed[0, :-1].long()
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert not routed[0, -1].any()  # the last token was never fed: no routing


def test_return_routed_experts_from_a_dense_server_fails_clearly(tmp_path):
    import asyncio

    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest
    from areal.models.tiny import get_tiny_base_path

    g = GenerationHyperparameters(n_samples=1, max_new_tokens=4, greedy=True)
    with local_engine(get_tiny_base_path(), return_routed_experts=True) as eng:
        with pytest.raises(RuntimeError, match="dense model routes nothing"):
            asyncio.run(eng.agenerate(ModelRequest(rid="r", input_ids=[5, 6, 7], gconfig=g)))


def test_splice_routing_keeps_each_position_from_the_chunk_that_generated_it():
    from areal.utils.moe_routing import routing_row, splice_routing

    # chunk 1: prompt of 4 + 3 new tokens -> rows for positions 0..5 (value 1)
    first = splice_routing(None, torch.ones(6, 2, 2, dtype=torch.int32), 4, "r")
    # resumed as 7 tokens + 2 new -> rows 0..7 (value 2): positions 0..5 keep chunk 1's
    both = splice_routing(first, torch.full((8, 2, 2), 2, dtype=torch.int32), 7, "r")
    assert both.shape == (8, 2, 2)
    assert (both[:6] == 1).all() and (both[6:] == 2).all()
    with pytest.raises(RuntimeError, match="returned no routed experts"):
        splice_routing(first, None, 7, "r")
    row = routing_row(both, 9)
    assert row.shape == (1, 9, 2, 2) and not row[0, -1].any()
    with pytest.raises(ValueError, match="5 rows for a sequence of 9"):
        routing_row(both[:5], 9)


def test_vllm_with_return_routed_experts_is_refused():
    from areal.api.cli_args import InferenceEngineConfig
    from areal.inference.clients.vllm import RemotevLLMEngine

    with pytest.raises(ValueError, match="vLLM does not return MoE routing"):
        RemotevLLMEngine(InferenceEngineConfig(return_routed_experts=True))


def test_server_loads_per_expert_checkpoint_tensors_into_fused_experts(moe_dir, tmp_path):
    """transformers fuses the experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``) that the
    checkpoint (and the trainers' export) keeps per expert: the server's disk load fills
    every slice, names by checkpoint name, and refuses a directory missing one expert."""
    from safetensors.torch import load_file, save_file

    from areal.inference.server.weights import checkpoint_tensors, load_weights_from_disk

    disk = load_file(os.path.join(moe_dir, "model.safetensors"))
    model = hf_model(moe_dir)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load_weights_from_disk(model, moe_dir) == len(disk)
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n
    view = checkpoint_tensors(model)
    assert set(disk) <= set(view)  # every checkpoint name is a view of the live model
    assert torch.equal(
        view["model.layers.0.mlp.experts.1.up_proj.weight"],
        disk["model.layers.0.mlp.experts.1.up_proj.weight"],
    )
    partial = {k: v for k, v in disk.items() if "experts.3.down_proj" not in k}
    os.makedirs(tmp_path / "partial")
    save_file(partial, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(ValueError, match="parameters missing"):
        load_weights_from_disk(model, str(tmp_path / "partial"))


def test_staged_load_fills_fused_experts_only_at_commit(moe_dir):
    """An in-flight update (``StagedWeights``) of an MoE model: the per-expert checkpoint
    tensors land in a staging copy of the fused parameters; the live ones move only at
    commit, then equal the checkpoint."""
    from areal.inference.server.weights import StagedWeights, load_weights_from_disk

    model = hf_model(moe_dir)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    staged = StagedWeights()
    staged.begin(model, 1)
    load_weights_from_disk(model, moe_dir, into=staged.targets())
    for n, p in model.named_parameters():
        assert torch.equal(p, served[n]), n
    staged.commit(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n
