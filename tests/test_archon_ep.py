"""Expert parallelism on real gloo ranks (CPU, spawned, fp32): the qwen3_moe model with
experts sharded over ``ep`` and tokens dispatched with ``all_to_all_single`` gives the
same loss and every parameter's gradient (gathered) as one process running the whole
batch (atol 1e-5). Model level (no engine: the engine's sessions are in the slow
``test_archon_engine.py``); each rank builds the 1-process reference itself.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist_helpers import run_ranks

ATOL = 1e-5
LENS = [[9, 5, 14], [3, 12, 8], [11, 6], [7, 10, 2]]  # per data-parallel rank (up to 4)


def _model(n_experts: int):
    from areal.models.archon.qwen3_moe import Qwen3MoeModel, Qwen3MoeModelArgs

    args = Qwen3MoeModelArgs(  # as from_hf_config reads a tiny Qwen3MoeConfig
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=48,
        vocab_size=64,
        norm_eps=1e-6,
        rope_theta=10000.0,
        n_experts=n_experts,
        top_k=2,
        moe_hidden_dim=16,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = Qwen3MoeModel(args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(lens):
    g = torch.Generator().manual_seed(sum(lens) * 7 + len(lens))
    ids = torch.randint(0, 64, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return ids, pos, cu


def _nll_sum(model, ids, pos, cu):
    logits = model(ids, pos, cu)
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[(cu[1:-1] - 1).long()] = False  # no prediction across a sequence boundary
    return -(lp * keep).sum(), int(keep.sum())


def _ranks(rank, world, dp, ep, n_experts, tp=1, hybrid=False, etp=1):
    import torch.distributed as dist

    from areal.models.archon import ArchonParallelDims
    from areal.models.archon.qwen3_moe import parallelize_qwen3_moe

    dist.init_process_group("gloo")
    batches = [_batch(LENS[r]) for r in range(dp)]
    ref = _model(n_experts)
    total = sum(_nll_sum(ref, *b)[1] for b in batches)
    ref_loss = sum(_nll_sum(ref, *b)[0] for b in batches) / total
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    dims = ArchonParallelDims(
        dp_shard=dp, ep=ep, tp=tp, etp=etp, world_size=world, device_type="cpu",
        ep_spans_cp_tp=hybrid,
    )  # fmt: skip
    dims.build_mesh()
    model = parallelize_qwen3_moe(_model(n_experts), dims)
    r = dims.get_mesh("dp_shard").get_local_rank()
    nll, _ = _nll_sum(model, *batches[r])
    (nll / total * dp).backward()  # FSDP averages over dp: the engine's scaling
    loss = (nll / total).detach()
    dist.all_reduce(loss, group=dims.get_group("dp_shard"))
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    local_experts, local_hidden, _ = model.layers["0"].moe.experts.w1.to_local().shape
    return {
        "loss": float(loss),
        "ref_loss": float(ref_loss.detach()),
        "grads": grads,
        "ref_grads": ref_grads,
        "local_experts": local_experts,
        "local_hidden": local_hidden,
    }


def _check(res, n_experts, ep, efsdp=1, etp=1):
    for r in res.values() if isinstance(res, dict) else res:
        assert abs(r["loss"] - r["ref_loss"]) < ATOL
        # stored per rank: n_experts / ep, FSDP-sharded again over efsdp = dp / ep; each
        # expert's hidden dimension (16) split over etp
        assert r["local_experts"] == n_experts // ep // efsdp
        assert r["local_hidden"] == 16 // etp
        assert set(r["grads"]) == set(r["ref_grads"])
        for k, w in r["ref_grads"].items():
            torch.testing.assert_close(r["grads"][k], w, atol=ATOL, rtol=0, msg=k)
        assert any("moe.experts" in k for k in r["grads"])


def test_ep2_on_two_ranks_equals_one_process():
    res = run_ranks(_ranks, 2, (2, 2, 4), timeout=300)
    _check([res[0], res[1]], 4, 2)


@pytest.mark.slow
@pytest.mark.archon_matrix
def test_d4e2_on_four_ranks_equals_one_process():
    # experts FSDP-sharded over the two ranks that hold the same experts (efsdp=2)
    res = run_ranks(_ranks, 4, (4, 2, 8), timeout=600)
    _check([res[r] for r in range(4)], 8, 2, efsdp=2)


@pytest.mark.slow
@pytest.mark.archon_matrix
def test_d2t2e2_on_four_ranks_equals_one_process():
    # attention tensor-parallel, routers and experts replicated over tp, experts split over ep
    res = run_ranks(_ranks, 4, (2, 2, 4, 2), timeout=600)
    _check([res[r] for r in range(4)], 4, 2)


@pytest.mark.slow
def test_hybrid_attn_t2_ffn_e2_on_two_ranks_equals_one_process():
    # archon:(attn:d1t2|ffn:d1e2): attention tensor-parallel over both ranks, the experts
    # split over the same two ranks (ep borrows the tp ranks, which hold the same tokens)
    res = run_ranks(_ranks, 2, (1, 2, 4, 2, True), timeout=300)
    _check([res[0], res[1]], 4, 2)


@pytest.mark.slow
def test_hybrid_attn_t2_ffn_t2_on_two_ranks_equals_one_process():
    # archon:(attn:t2|ffn:t2), expert tensor parallelism: each tensor rank holds half of
    # every expert's hidden dimension, the partial outputs are summed over tp
    res = run_ranks(_ranks, 2, (1, 1, 4, 2, False, 2), timeout=300)
    _check([res[0], res[1]], 4, 1, etp=2)


@pytest.mark.slow
@pytest.mark.archon_matrix
def test_hybrid_attn_d2t2_ffn_e2t2_on_four_ranks_equals_one_process():
    # archon:(attn:d2t2|ffn:e2t2): experts split over the two data ranks (ep) and each
    # over the two tensor ranks (etp)
    res = run_ranks(_ranks, 4, (2, 2, 4, 2, False, 2), timeout=600)
    _check([res[r] for r in range(4)], 4, 2, etp=2)


@pytest.mark.slow
@pytest.mark.archon_matrix
def test_hybrid_attn_d2t2_ffn_d2e2_on_four_ranks_equals_one_process():
    # archon:(attn:d2t2|ffn:d2e2): ep over each tp pair, experts FSDP-sharded over ffn d2
    res = run_ranks(_ranks, 4, (2, 2, 4, 2, True), timeout=600)
    _check([res[r] for r in range(4)], 4, 2, efsdp=2)


def _engine_session(rank, world, path, layout, replay, save_dir=None, archon=None):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
    from areal.engine.archon import ArchonEngine

    cfg = TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        backend=f"archon:{layout}",
        optimizer=OptimizerConfig(
            type="sgd", lr=0.5, weight_decay=0.0, warmup_steps_proportion=0.0, gradient_clipping=1e9
        ),
        mb_spec=MicroBatchSpec(),
        num_threads=1,
    )
    cfg.archon.router_replay = replay
    for k, v in (archon or {}).items():
        setattr(cfg.archon, k, v)
    eng = ArchonEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    g = torch.Generator().manual_seed(3)
    B, T = 4, 16
    lens = torch.tensor([16, 9, 12, 5])
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    batch = {
        "input_ids": torch.randint(3, 64, (B, T), generator=g) * mask,
        "attention_mask": mask,
        "loss_mask": mask,
        # a routing unlike the router's: replay must change the loss
        "routed_experts": torch.stack(
            [torch.randperm(4, generator=g)[:2] for _ in range(B * T * 2)]
        ).view(B, T, 2, 2),
    }
    dp, r = eng.data_parallel_world_size, eng.data_parallel_rank
    part = {k: v[r::dp] for k, v in batch.items()}
    grads: dict[str, torch.Tensor] = {}
    step_fn = eng.optimizer.step

    def recording_step(*a, **k):
        for n, p in eng.model.named_parameters():
            g = p.grad
            grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
        return step_fn(*a, **k)

    eng.optimizer.step = recording_step

    def loss_fn(logp, _ent, d):
        m = d["loss_mask"].float()
        return -(logp * m).sum() / m.sum()

    stats = eng.train_batch(part, loss_fn, lambda d: d["loss_mask"].sum())
    res = {"loss": stats["loss"], "grads": grads}
    res["params"] = {  # after one SGD step
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in eng.model.named_parameters()
    }
    if save_dir:  # HF save (per-expert names) and the sharded export, from ep shards
        eng.save(SaveLoadMeta(path=os.path.join(save_dir, "hf"), weight_format="hf"))
        res["shard_bytes"] = eng.export_weight_shards(
            os.path.join(save_dir, "shards"), shard_mb=0.01
        )
    eng.destroy()
    return res


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
    )
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = str(tmp_path_factory.mktemp("moe"))
    model.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True], ids=["routed", "replayed"])
def test_engine_d2e2_equals_d1(moe_ckpt, replay, tmp_path):
    base = run_ranks(_engine_session, 1, (moe_ckpt, "d1", replay), timeout=600)[0]
    save = str(tmp_path) if not replay else None
    res = run_ranks(_engine_session, 2, (moe_ckpt, "d2e2", replay, save), timeout=600)
    for r in (res[0], res[1]):
        assert abs(r["loss"] - base["loss"]) < ATOL
        assert set(r["grads"]) == set(base["grads"])
        for k, w in base["grads"].items():
            torch.testing.assert_close(r["grads"][k], w, atol=ATOL, rtol=0, msg=k)
    if save is None:
        return
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from areal.models.archon.qwen3_moe import Qwen3MoeModelArgs, Qwen3MoeStateDictAdapter

    # the trained weights, saved from the expert shards, load in transformers
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(save, "hf"), dtype=torch.float32)
    adapter = Qwen3MoeStateDictAdapter(Qwen3MoeModelArgs.from_hf_config(hf.config))
    loaded = adapter.from_hf(hf.state_dict())
    trained = res[0]["params"]
    assert set(loaded) == set(trained)
    for k, v in trained.items():
        torch.testing.assert_close(loaded[k], v, atol=0, rtol=0, msg=k)
    seen: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(os.path.join(save, "shards"))):
        if f.endswith(".safetensors"):
            part = load_file(os.path.join(save, "shards", f))
            assert not set(part) & set(seen), "a tensor written twice"
            seen.update(part)
    want = adapter.to_hf(trained)
    assert set(seen) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(seen[k], v, atol=0, rtol=0, msg=k)
    assert all(r["shard_bytes"] > 0 for r in (res[0], res[1]))


@pytest.mark.slow
@pytest.mark.archon_matrix
@pytest.mark.parametrize("layout", ["(attn:d2t2|ffn:d2e2)", "(attn:d2t2|ffn:e2t2)"])
def test_engine_hybrid_4_ranks_equals_d1(moe_ckpt, layout):
    # the MoE hybrid form through the engine (etp=1: ep over each tp pair; etp=2: each
    # expert split over tp too): loss, every gradient and the stepped weights equal one rank's
    base = run_ranks(_engine_session, 1, (moe_ckpt, "d1", False), timeout=600)[0]
    res = run_ranks(_engine_session, 4, (moe_ckpt, layout, False), timeout=900)
    for r in (res[i] for i in range(4)):
        assert abs(r["loss"] - base["loss"]) < ATOL
        assert set(r["grads"]) == set(base["grads"]) == set(r["params"])
        for k, w in base["grads"].items():
            torch.testing.assert_close(r["grads"][k], w, atol=ATOL, rtol=0, msg=k)
        for k, w in base["params"].items():
            torch.testing.assert_close(r["params"][k], w, atol=ATOL, rtol=0, msg=k)


@pytest.fixture(scope="module")
def moe_aux_ckpt(moe_ckpt, tmp_path_factory):
    """``moe_ckpt`` whose config trains the load-balancing loss (output_router_logits,
    router_aux_loss_coef 0.5: large enough to move the gradients well past atol)."""
    import json
    import shutil

    path = str(tmp_path_factory.mktemp("moe_aux"))
    shutil.copytree(moe_ckpt, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(output_router_logits=True, router_aux_loss_coef=0.5)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _assert_stages_equal(ranks: list[dict], base: dict) -> None:
    """Pipeline ranks hold their stages' parameters: together they are the model; the
    loss, every gradient and every weight after the SGD step equal one rank's."""
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for r in ranks:
        assert abs(r["loss"] - base["loss"]) < ATOL
        grads.update(r["grads"])
        params.update(r["params"])
    assert set(grads) == set(base["grads"]) == set(params)
    for k, w in base["grads"].items():
        torch.testing.assert_close(grads[k], w, atol=ATOL, rtol=0, msg=f"grad {k}")
    for k, w in base["params"].items():
        torch.testing.assert_close(params[k], w, atol=ATOL, rtol=0, msg=f"param {k}")


@pytest.mark.slow
@pytest.mark.archon_matrix  # 2 ranks, but about 40 s
def test_engine_p2_moe_with_aux_loss_and_replay_equals_d1(moe_aux_ckpt):
    # pipeline stages of the MoE model (Interleaved1F1B, 4 virtual stages on 2 ranks):
    # the load-balancing loss's sums travel stage to stage, the routing is replayed by
    # each stage's own layers; loss, gradients and stepped weights equal one rank's
    base = run_ranks(_engine_session, 1, (moe_aux_ckpt, "d1", True), timeout=600)[0]
    res = run_ranks(_engine_session, 2, (moe_aux_ckpt, "d1p2", True), timeout=600)
    assert not set(res[0]["params"]) & set(res[1]["params"])
    _assert_stages_equal([res[0], res[1]], base)


@pytest.mark.slow
@pytest.mark.archon_matrix
@pytest.mark.parametrize(
    "aux,replay,schedule,ref",
    [(False, True, "1F1B", "d1"), (True, False, "Interleaved1F1B", "d2e2")],
    ids=["replayed-1F1B-vs-d1", "aux-interleaved-vs-d2e2"],
)
def test_engine_d2e2p2_moe_equals_reference(moe_ckpt, moe_aux_ckpt, aux, replay, schedule, ref):
    # archon:d2e2p2: the experts of each stage split over its two data-parallel ranks.
    # The load-balancing loss is each data rank's own (its tokens, as transformers' per
    # batch), so with it the reference is d2e2 without stages; without it, one rank
    path = moe_aux_ckpt if aux else moe_ckpt
    base = run_ranks(_engine_session, int(ref[1]), (path, ref, replay), timeout=600)[0]
    args = (path, "d2e2p2", replay, None, {"pp_schedule": schedule})
    res = run_ranks(_engine_session, 4, args, timeout=900)
    for d in (0, 1):  # the two pipeline ranks of data-parallel rank d: ranks d and d + 2
        _assert_stages_equal([res[d], res[d + 2]], base)


def _aux_session(rank, world, path):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.archon import ArchonEngine

    cfg = TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        backend="archon:d1",
        optimizer=OptimizerConfig(type="sgd", lr=0.0, warmup_steps_proportion=0.0),
        mb_spec=MicroBatchSpec(),
        num_threads=1,
    )
    eng = ArchonEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[0, 0] = 0  # the first token is not predicted

    def loss_fn(logp, _ent, d):
        m = d["loss_mask"].float()
        return -(logp * m).sum() / m.sum()

    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    stats = eng.train_batch(batch, loss_fn, lambda d: d["loss_mask"].sum())
    eng.destroy()
    return {"loss": stats["loss"], "ids": ids}


@pytest.mark.slow
def test_engine_adds_the_load_balancing_loss_as_transformers(moe_ckpt, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(moe_ckpt)
    cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.5
    hf = AutoModelForCausalLM.from_pretrained(moe_ckpt, config=cfg, dtype=torch.float32)
    hf.save_pretrained(str(tmp_path))
    r = run_ranks(_aux_session, 1, (str(tmp_path),), timeout=600)[0]
    with torch.no_grad():
        out = hf(input_ids=r["ids"], labels=r["ids"])  # mean CE + 0.5 x aux
    assert out.aux_loss > 0.5
    assert abs(r["loss"] - float(out.loss)) < ATOL


def _ckpt_session(rank, world, path, layout, steps, save_dir, load_dir):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
    from areal.engine.archon import ArchonEngine

    cfg = TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        backend=f"archon:{layout}",
        optimizer=OptimizerConfig(
            type="adam", lr=1e-2, warmup_steps_proportion=0.0, gradient_clipping=1e9
        ),
        mb_spec=MicroBatchSpec(),
        num_threads=1,
    )
    eng = ArchonEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    if load_dir:
        eng.load(SaveLoadMeta(path=load_dir, weight_format="dcp", with_optim=True))

    def loss_fn(logp, _ent, d):
        m = d["loss_mask"].float()
        return -(logp * m).sum() / m.sum()

    out = {}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        lens = torch.tensor([16, 9, 12, 5])
        mask = (torch.arange(16)[None] < lens[:, None]).long()
        batch = {
            "input_ids": torch.randint(3, 64, (4, 16), generator=g) * mask,
            "attention_mask": mask,
            "loss_mask": mask,
        }
        dp, r = eng.data_parallel_world_size, eng.data_parallel_rank
        part = {k: v[r::dp] for k, v in batch.items()}
        out[f"loss{step}"] = eng.train_batch(part, loss_fn, lambda d: d["loss_mask"].sum())["loss"]
        if save_dir and step == steps[0]:
            eng.save(SaveLoadMeta(path=save_dir, weight_format="dcp", with_optim=True))
    out["params"] = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in eng.model.named_parameters()
    }
    eng.destroy()
    return out


@pytest.mark.slow
@pytest.mark.archon_matrix
def test_dcp_saved_at_e2_resumes_at_e1_next_step_equal(moe_ckpt, tmp_path):
    ckpt = str(tmp_path / "dcp")
    base = run_ranks(_ckpt_session, 1, (moe_ckpt, "d1", [1, 2], None, None), timeout=600)[0]
    run_ranks(_ckpt_session, 2, (moe_ckpt, "d2e2", [1], ckpt, None), timeout=600)
    res = run_ranks(_ckpt_session, 1, (moe_ckpt, "d1", [2], None, ckpt), timeout=600)[0]
    assert abs(res["loss2"] - base["loss2"]) < ATOL
    for k, v in base["params"].items():
        torch.testing.assert_close(res["params"][k], v, atol=ATOL, rtol=0, msg=k)
