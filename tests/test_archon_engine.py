"""ArchonEngine on real gloo ranks (CPU, spawned processes, fp32): for each layout the
loss, every parameter's gradient (HF names, gathered) and the weights after one SGD step
equal a 1-rank run (atol 1e-5); a DCP checkpoint written at t2 resumes at d2 with the
next step equal to the uninterrupted run; the HF save and the sharded weight export
hold every tensor once with the trained values.

One session per layout (process start-up dominates); tests assert on their results.
The whole file is ``slow`` (about 70 s for the 2-rank set, 80 s per 4-rank layout): the
full check runs it, ``make test`` does not.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist_helpers import run_ranks

pytestmark = pytest.mark.slow

ATOL = 1e-5
# log-probabilities reach |6-8| (vocabulary 400): a sharded reduction's reordering moves
# them by a few fp32 ulps of that size (1.1e-5 at 8.4 seen on an AVX-512 Xeon)
LOGP_RTOL = 1e-5
B, T, VOCAB = 8, 24, 400
LR = 0.5


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([24, 9, 17, 5, 21, 12, 3, 15])
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < lens[:, None]).long()
    prompt = torch.tensor([5, 3, 6, 2, 8, 4, 1, 7])
    loss_mask = ((torch.arange(T)[None, :] >= prompt[:, None]) & mask.bool()).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask}


def loss_fn(logp, entropy, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum() - 0.01 * (entropy * m).sum() / m.sum()


def loss_weight_fn(d):
    return d["loss_mask"].sum()


def build_tiny_qwen3(path: str, seed: int = 0) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def load_safetensors_once(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder``; fails when one is
    written in two files."""
    from safetensors.torch import load_file

    seen: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            part = load_file(os.path.join(folder, f))
            assert not set(part) & set(seen), "a tensor written twice"
            seen.update(part)
    return seen


def _full(eng) -> dict[str, torch.Tensor]:
    """Every exported tensor by HF name, gathered (collective)."""
    out = {}
    for k, v in eng._export_tensors().items():
        v = v.detach()
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def _session(rank, world, path, layout, steps, save_dir, load_dir, export_dir, archon=None):
    from areal.api.cli_args import (
        ArchonEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
    from areal.engine.archon import ArchonEngine

    archon = dict(archon or {})
    xccl = archon.pop("xccl", None)  # (spec_q, ack_q, port): push to _receiver at the end
    cfg = TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        backend=f"archon:{layout}",
        optimizer=OptimizerConfig(
            type="sgd", lr=LR, weight_decay=0.0, warmup_steps_proportion=0.0, gradient_clipping=1e9
        ),
        mb_spec=MicroBatchSpec(**archon.pop("mb_spec", {})),
        num_threads=1,
        archon=ArchonEngineConfig(**archon),
    )
    eng = ArchonEngine(cfg)
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    names = {id(p): n for n, p in eng._export_tensors().items()}
    captured: dict[str, torch.Tensor] = {}
    step_fn = eng.optimizer.step

    def recording_step(*a, **k):  # the gradients the optimizer is about to apply
        captured.clear()
        for p in eng.model.parameters():
            if id(p) in names and p.grad is not None:
                g = p.grad
                captured[names[id(p)]] = (
                    g.full_tensor() if hasattr(g, "full_tensor") else g
                ).clone()
        return step_fn(*a, **k)

    eng.optimizer.step = recording_step
    if load_dir:
        eng.load(SaveLoadMeta(path=load_dir, weight_format="dcp", with_optim=True))
    res = {"dp_rank": eng.data_parallel_rank, "dp": eng.data_parallel_world_size}
    res["head"] = eng.is_data_parallel_head()
    for step in steps:
        batch = make_batch(step)
        dp, r = eng.data_parallel_world_size, eng.data_parallel_rank
        rows = list(range(r, B, dp))
        part = {k: v[rows] for k, v in batch.items()}
        stats = eng.train_batch(part, loss_fn, loss_weight_fn)
        res[f"loss{step}"] = stats["loss"]
        res[f"grad_norm{step}"] = stats["grad_norm"]
        res[f"grads{step}"] = dict(captured)
        res[f"params{step}"] = _full(eng)
        res[f"logp{step}"] = eng.forward_batch(part)
        if save_dir and step == steps[0]:
            eng.save(SaveLoadMeta(path=save_dir, weight_format="dcp", with_optim=True))
    if export_dir:
        # verified weight sync: digests taken while each tensor is gathered (pipeline
        # stages: every stage fingerprints its own tensors when asked)
        eng.enable_weight_fingerprints(full_every=1, reference_root=export_dir)
        eng.save(SaveLoadMeta(path=os.path.join(export_dir, "hf"), weight_format="hf"))
        res["fingerprints"] = eng.weights_fingerprint(0)
        res["shard_bytes"] = eng.export_weight_shards(
            os.path.join(export_dir, "shards"), shard_mb=0.05
        )
    if xccl:  # the xccl weight push to a receiver process in the weight-update group
        from test_fsdp_engine import FakeInferenceEngine

        from areal.api.io_struct import WeightUpdateMeta

        spec_q, ack_q, port = xccl
        meta = WeightUpdateMeta(
            type="xccl", master_port=port, world_size=2, weight_chunked_mem_mb=1, version=1
        )
        if rank == 0:
            eng.connect_engine(FakeInferenceEngine(spec_q, ack_q), meta)
        eng.update_weights(meta)
        res["pushed"] = _full(eng)
        res["push_fingerprints"] = eng.weights_fingerprint(0)  # the push's digests
        if rank == 0:
            res["specs"] = [sp.name for b in eng.get_param_specs(1) for sp in b]
            spec_q.put(("done",))
    eng.destroy()
    return res


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from conftest import build_tiny_qwen2

    d = tmp_path_factory.mktemp("archon_models")
    return {
        "qwen2": build_tiny_qwen2(str(d / "qwen2")),
        "qwen3": build_tiny_qwen3(str(d / "qwen3")),
    }


def _run(models, family, layout, world, steps=(1,), **kw):
    args = (
        models[family], layout, list(steps), kw.get("save"), kw.get("load"), kw.get("export"),
        kw.get("archon"),
    )  # fmt: skip
    res = run_ranks(_session, world, args, timeout=600, extra=kw.get("extra", ()))
    if kw.get("extra"):
        return [res[r] for r in range(world)] + [res["extra"]]
    return [res[r] for r in range(world)]


@pytest.fixture(scope="module")
def base_qwen2(models):
    return _run(models, "qwen2", "d1", 1, steps=(1, 2))[0]


@pytest.fixture(scope="module")
def base_qwen3(models):
    return _run(models, "qwen3", "d1", 1)[0]


@pytest.fixture(scope="module")
def t2_qwen2(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("t2")
    ckpt, export = str(d / "dcp"), str(d / "export")
    res = _run(models, "qwen2", "d1t2", 2, save=ckpt, export=export)
    return {"ranks": res, "ckpt": ckpt, "export": export}


def _assert_step_equal(got: dict, want: dict, step: int = 1):
    assert abs(got[f"loss{step}"] - want[f"loss{step}"]) < ATOL
    assert abs(got[f"grad_norm{step}"] - want[f"grad_norm{step}"]) < ATOL
    g, w = got[f"grads{step}"], want[f"grads{step}"]
    assert set(g) == set(w) and len(w) > 0
    for k in w:
        torch.testing.assert_close(g[k], w[k], atol=ATOL, rtol=0, msg=f"grad {k}")
    p, q = got[f"params{step}"], want[f"params{step}"]
    assert set(p) == set(q)
    for k in q:
        torch.testing.assert_close(p[k], q[k], atol=ATOL, rtol=0, msg=f"param {k}")


def test_tp2_equals_one_rank(t2_qwen2, base_qwen2):
    for r in t2_qwen2["ranks"]:
        assert r["dp"] == 1 and r["dp_rank"] == 0
        _assert_step_equal(r, base_qwen2)
    assert [r["head"] for r in t2_qwen2["ranks"]] == [True, False]
    torch.testing.assert_close(
        t2_qwen2["ranks"][0]["logp1"], base_qwen2["logp1"], atol=ATOL, rtol=LOGP_RTOL
    )


def test_cp2_equals_one_rank(models, base_qwen2):
    res = _run(models, "qwen2", "d1c2", 2)
    for r in res:
        _assert_step_equal(r, base_qwen2)
    torch.testing.assert_close(res[1]["logp1"], base_qwen2["logp1"], atol=ATOL, rtol=LOGP_RTOL)


def test_dcp_saved_at_t2_resumes_at_d2_next_step_equal(models, t2_qwen2, base_qwen2):
    res = _run(models, "qwen2", "d2", 2, steps=(2,), load=t2_qwen2["ckpt"])
    assert [r["dp_rank"] for r in res] == [0, 1]
    for r in res:
        _assert_step_equal(r, base_qwen2, step=2)


def test_hf_save_and_sharded_export_hold_every_tensor_once(t2_qwen2, base_qwen2):
    from safetensors.torch import load_file

    want = base_qwen2["params1"]
    hf_dir = os.path.join(t2_qwen2["export"], "hf")
    saved = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert set(saved) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(saved[k], v, atol=ATOL, rtol=0)
    seen = load_safetensors_once(os.path.join(t2_qwen2["export"], "shards"))
    assert set(seen) == set(want)
    assert sum(r["shard_bytes"] for r in t2_qwen2["ranks"]) == sum(
        v.numel() * v.element_size() for v in want.values()
    )
    assert all(r["shard_bytes"] > 0 for r in t2_qwen2["ranks"])  # the work is split


def test_weight_fingerprints_of_the_export_match_the_saved_files(t2_qwen2):
    from safetensors.torch import load_file

    from areal.infra.weights.fingerprint import (
        REFERENCE_FILE,
        compare_fingerprints,
        fingerprint_named,
    )

    hf_dir = os.path.join(t2_qwen2["export"], "hf")
    assert os.path.exists(os.path.join(hf_dir, REFERENCE_FILE))
    ref = t2_qwen2["ranks"][0]["fingerprints"]
    saved = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert set(ref) == set(saved)
    assert compare_fingerprints(ref, fingerprint_named(saved)) == []
    name = "model.layers.1.mlp.down_proj.weight"
    saved[name] = saved[name].clone()
    saved[name][0, 0] += 1e-2  # what a server holding a stale or wrong tensor answers
    bad = compare_fingerprints(ref, fingerprint_named(saved))
    assert len(bad) == 1 and name in bad[0]


def test_hf_save_loads_in_transformers_with_same_logprobs(t2_qwen2, base_qwen2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(t2_qwen2["export"], "hf"), dtype=torch.float32
    ).eval()
    batch = make_batch(1)
    n = int(batch["attention_mask"][0].sum())
    ids = batch["input_ids"][:1, :n]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0], -1)[:-1].gather(-1, ids[0, 1:, None])
    # the trained model (after step 1) scores row 0 as the engine's forward does
    assert lp.shape[0] == n - 1
    engine_lp = base_qwen2["logp1"][0, 1:n]
    torch.testing.assert_close(lp[:, 0], engine_lp, atol=ATOL, rtol=LOGP_RTOL)


@pytest.mark.slow
def test_qwen3_tp2_equals_one_rank(models, base_qwen3):
    # q/k norms see only this rank's heads: their gradients are summed over tp
    for r in _run(models, "qwen3", "d1t2", 2):
        _assert_step_equal(r, base_qwen3)


@pytest.mark.slow
def test_d2t2_equals_one_rank(models, base_qwen2):
    res = _run(models, "qwen2", "d2t2", 4)
    assert [r["dp_rank"] for r in res] == [0, 0, 1, 1]
    for r in res:
        _assert_step_equal(r, base_qwen2)


@pytest.mark.slow
def test_d2c2_equals_one_rank(models, base_qwen2):
    res = _run(models, "qwen2", "d2c2", 4)
    assert [r["dp_rank"] for r in res] == [0, 0, 1, 1]
    for r in res:
        _assert_step_equal(r, base_qwen2)


# ---------------------------------------------------------------- pipeline parallel
def _assert_pp_step_equal(ranks: list[dict], want: dict, step: int = 1, rows=slice(None)):
    """Each rank holds its stages' tensors: together they are the model, each equal."""
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for r in ranks:
        assert abs(r[f"loss{step}"] - want[f"loss{step}"]) < ATOL
        assert abs(r[f"grad_norm{step}"] - want[f"grad_norm{step}"]) < ATOL
        grads.update(r[f"grads{step}"])
        params.update(r[f"params{step}"])
    assert set(grads) == set(want[f"grads{step}"]) and set(params) == set(want[f"params{step}"])
    for k, w in want[f"grads{step}"].items():
        torch.testing.assert_close(grads[k], w, atol=ATOL, rtol=0, msg=f"grad {k}")
    for k, w in want[f"params{step}"].items():
        torch.testing.assert_close(params[k], w, atol=ATOL, rtol=0, msg=f"param {k}")
    for r in ranks:  # every pipeline rank gets the last stage's forward output
        # rtol: logprobs of ~-6 from other matmul shapes (micro-batch packing) than the
        # 1-rank run's differ by a few float32 ulps of the logits
        torch.testing.assert_close(
            r[f"logp{step}"], want[f"logp{step}"][rows], atol=ATOL, rtol=1e-5
        )


@pytest.fixture(scope="module")
def p2_qwen2(models, tmp_path_factory):
    """p2 with AReaL's default schedule (Interleaved1F1B: 4 virtual stages, the first
    holding only the embedding and the last only the head); two micro-batches."""
    from _dist_helpers import free_port
    from test_fsdp_engine import _receiver

    d = tmp_path_factory.mktemp("p2")
    ckpt, export = str(d / "dcp"), str(d / "export")
    ctx = torch.multiprocessing.get_context("spawn")
    spec_q, ack_q, recv = ctx.Queue(), ctx.Queue(), str(d / "received.pt")
    *res, extra = _run(
        models, "qwen2", "d1p2", 2, steps=(1, 2), save=ckpt, export=export,
        archon={"mb_spec": {"n_mbs": 2}, "xccl": (spec_q, ack_q, free_port())},
        extra=[(_receiver, (spec_q, ack_q, recv))],
    )  # fmt: skip
    received = {"tensors": torch.load(recv), "n_buckets": extra[0]}
    return {"ranks": res, "ckpt": ckpt, "export": export, "received": received}


def test_pp2_interleaved_two_steps_equal_one_rank(p2_qwen2, base_qwen2):
    ranks = p2_qwen2["ranks"]
    assert [r["dp"] for r in ranks] == [1, 1]
    assert [r["head"] for r in ranks] == [True, False]
    for step in (1, 2):
        _assert_pp_step_equal(ranks, base_qwen2, step)
    # each stage holds its own tensors: the embedding on rank 0, the head on rank 1
    assert "model.embed_tokens.weight" in ranks[0]["params1"]
    assert "lm_head.weight" in ranks[1]["params1"]
    assert not set(ranks[0]["params1"]) & set(ranks[1]["params1"])


def test_dcp_saved_at_p2_resumes_at_p1_next_step_equal(models, p2_qwen2, base_qwen2):
    res = _run(models, "qwen2", "d1", 1, steps=(2,), load=p2_qwen2["ckpt"])
    _assert_step_equal(res[0], base_qwen2, step=2)


def test_pp2_hf_save_and_sharded_export_hold_every_tensor_once(p2_qwen2, base_qwen2):
    from safetensors.torch import load_file

    want = base_qwen2["params2"]
    hf_dir = os.path.join(p2_qwen2["export"], "hf")
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        index = __import__("json").load(f)
    assert set(index["weight_map"]) == set(want)
    for part in (
        os.path.join(p2_qwen2["export"], "hf"),
        os.path.join(p2_qwen2["export"], "shards"),
    ):
        seen: dict[str, torch.Tensor] = {}
        for f in sorted(os.listdir(part)):
            if f.endswith(".safetensors"):
                got = load_file(os.path.join(part, f))
                assert not set(got) & set(seen), "a tensor written twice"
                seen.update(got)
        assert set(seen) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(seen[k], v, atol=ATOL, rtol=0)
    assert all(r["shard_bytes"] > 0 for r in p2_qwen2["ranks"])  # each stage writes its own


@pytest.mark.archon_matrix
@pytest.mark.parametrize(
    "layout,schedule",
    [("d2p2", "1F1B"), ("p2t2", "GPipe"), ("d2p2", "Interleaved1F1B"), ("c2p2", "1F1B")],
)
def test_pp_combined_layouts_equal_one_rank(models, base_qwen2, layout, schedule):
    res = _run(models, "qwen2", layout, 4, archon={"pp_schedule": schedule})
    dp = 2 if layout.startswith("d2") else 1
    assert sorted(r["dp_rank"] for r in res) == sorted([0, 1] * 2 if dp == 2 else [0] * 4)
    # the ranks of one data-parallel rank make one model
    for d in range(dp):
        rows = list(range(d, B, dp))  # this data-parallel rank's rows of the batch
        _assert_pp_step_equal([r for r in res if r["dp_rank"] == d], base_qwen2, rows=rows)


@pytest.mark.archon_matrix
def test_dcp_saved_at_p2_resumes_at_d2_next_step_equal(models, p2_qwen2, base_qwen2):
    res = _run(models, "qwen2", "d2", 2, steps=(2,), load=p2_qwen2["ckpt"])
    for r in res:
        _assert_step_equal(r, base_qwen2, step=2)


def test_pp2_xccl_push_sends_every_stage_tensor_once(p2_qwen2):
    # p2 (Interleaved1F1B: 4 virtual stages over 2 ranks): rank 0 pushes its stages and
    # relays rank 1's, bucket by bucket, to a receiver in the weight-update group
    r0, r1 = p2_qwen2["ranks"]
    own0, own1 = r0["pushed"], r1["pushed"]
    assert own0 and own1 and not set(own0) & set(own1)  # each rank holds only its stages
    want = {**own0, **own1}
    got = p2_qwen2["received"]["tensors"]
    assert r0["specs"] == list(own0) + list(own1) and sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert p2_qwen2["received"]["n_buckets"] > 1  # several buckets, each acknowledged


def test_pp2_weight_fingerprints_cover_every_stage_after_save_and_xccl_push(p2_qwen2):
    # verified weight sync at p2: asked after the HF save, every stage fingerprints its
    # own tensors (same answer on both ranks); after the xccl push, rank 0's digests of
    # what it broadcast (its stages and the relayed ones) answer alone
    from areal.infra.weights.fingerprint import compare_fingerprints, fingerprint_named

    r0, r1 = p2_qwen2["ranks"]
    received = p2_qwen2["received"]["tensors"]
    assert set(r0["fingerprints"]) == set(received) and r1["fingerprints"] == r0["fingerprints"]
    assert compare_fingerprints(r0["fingerprints"], fingerprint_named(received)) == []
    push = r0["push_fingerprints"]
    assert set(push) == set(received) and r1["push_fingerprints"] == {}
    assert compare_fingerprints(push, fingerprint_named(received)) == []
    name = next(n for n in sorted(r1["pushed"]) if n.endswith("down_proj.weight"))  # stage 2+
    stale = dict(received, **{name: received[name].clone()})
    stale[name][0, 0] += 1e-2  # what a server holding a stale or wrong tensor answers
    bad = compare_fingerprints(push, fingerprint_named(stale))
    assert len(bad) == 1 and name in bad[0]
