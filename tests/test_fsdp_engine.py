"""FSDPEngine on real gloo ranks (CPU): equivalence, packing, checkpoints, weight export.

Two module-scoped sessions do the work (process start-up dominates the cost): a 1-rank
session on the whole batch and a 2-rank session (each rank half the batch) plus a
receiver process for the xccl broadcast. Individual tests assert on their results.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future

import pytest
import torch
from _dist_helpers import run_ranks

ATOL = 1e-5
B, T, VOCAB = 8, 48, 400


# ----------------------------------------------------------------------------- data
def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([48, 9, 30, 17, 41, 5, 23, 36])
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < lens[:, None]).long()
    ids = ids * mask
    prompt = torch.tensor([10, 3, 12, 6, 20, 2, 8, 15])
    loss_mask = ((torch.arange(T)[None, :] >= prompt[:, None]) & mask.bool()).long()
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "rewards": torch.randn(B, generator=g),
    }


def make_grouped_batch(seed: int = 5, prompts: int = 3, group: int = 4):
    """``prompts`` x ``group`` rows, each group sharing a prompt of 10-16 tokens, own
    completions of 3-20 tokens (half of a group also share their first 2)."""
    g = torch.Generator().manual_seed(seed)
    rows, starts = [], []
    for _ in range(prompts):
        prompt = torch.randint(
            3, VOCAB, (int(torch.randint(10, 17, (1,), generator=g)),), generator=g
        )
        head = torch.randint(3, VOCAB, (2,), generator=g)
        for k in range(group):
            c = torch.randint(
                3, VOCAB, (int(torch.randint(3, 21, (1,), generator=g)),), generator=g
            )
            if k % 2 == 0:
                c[:2] = head
            rows.append(torch.cat([prompt, c]))
            starts.append(prompt.numel())
    t = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, (r, p) in enumerate(zip(rows, starts, strict=True)):
        ids[i, : r.numel()], mask[i, : r.numel()], loss_mask[i, p : r.numel()] = r, 1, 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def _cu_of(mask: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))


def loss_fn(logp, entropy, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum() - 0.01 * (entropy * m).sum() / m.sum()


def loss_weight_fn(d):
    return d["loss_mask"].sum()


def critic_loss_fn(values, _entropy, d):
    m = d["loss_mask"].float()
    target = torch.repeat_interleave(
        d["rewards"], (d["cu_seqlens"][1:] - d["cu_seqlens"][:-1]).long()
    )
    return (((values - target) ** 2) * m).sum() / m.sum()


def make_config(path: str, max_tokens: int | None = None, critic: bool = False, **opt):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    # Adam's first step is ~lr * sign(grad): with eps=1e-8, float32 rounding noise on a
    # near-zero gradient moves a parameter by up to lr. eps=1e-6 keeps the comparison of
    # updated parameters meaningful at atol 1e-5 (gradients are compared via grad_norm).
    oc = dict(
        lr=1e-3, eps=1e-6, weight_decay=0.01, warmup_steps_proportion=0.0, gradient_clipping=1.0
    )
    oc.update(opt)
    return TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        optimizer=OptimizerConfig(**oc),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
        is_critic=critic,
        num_threads=1,
    )


def make_engine(
    path: str, max_tokens: int | None = None, critic: bool = False, total_steps=10, **opt
):
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    eng = FSDPEngine(make_config(path, max_tokens, critic, **opt))
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, total_steps, 1))
    return eng


def reference_logprobs(path: str, batch, temperature: float = 1.0) -> torch.Tensor:
    """Plain transformers, one padded-free sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = torch.zeros(batch["input_ids"].shape)
    lens = batch["attention_mask"].sum(1).tolist()
    with torch.no_grad():
        for b, n in enumerate(lens):
            ids = batch["input_ids"][b : b + 1, :n]
            logits = model(input_ids=ids).logits[0].float() / temperature
            lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            out[b, 1:n] = lp
    return out


def full_params(eng) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng._full_state_dict().items()}


# ----------------------------------------------------------------------------- sessions
def _one_rank_session(rank, world_size, path, tied_path, out_dir):
    batch = make_batch()
    res = {}
    eng = make_engine(path)
    res["fwd"] = eng.forward_batch(batch)
    res["ref"] = reference_logprobs(path, batch)
    eng.temperature = 0.7
    res["fwd_t07"] = eng.forward_batch(batch)
    res["ref_t07"] = reference_logprobs(path, batch, 0.7)
    eng.temperature = 1.0
    eng._head.chunk_size, eng._head.chunk_bytes = 7, 0  # force many logprob chunks
    res["fwd_chunked"] = eng.forward_batch(batch)
    eng._head.chunk_size, eng._head.chunk_bytes = 1024, 128 << 20
    res["stats"] = eng.train_batch(batch, loss_fn, loss_weight_fn)
    res["params"] = full_params(eng)
    eng.step_lr_scheduler()

    # Same step split into many small micro-batches (and small logprob chunks).
    eng2 = make_engine(path, max_tokens=60)
    eng2._head.chunk_size, eng2._head.chunk_bytes = 16, 0  # chunked + checkpointed head
    res["stats_small_mb"] = eng2.train_batch(batch, loss_fn, loss_weight_fn)
    res["params_small_mb"] = full_params(eng2)
    res["n_mbs_small"] = len(eng2._split(batch))

    # GRPO-shaped batch (samples of a prompt share it): the shared-prefix layout gives
    # the same logprobs, loss and update as every sequence packed on its own.
    gb = make_grouped_batch()
    for share in (True, False):
        e = make_engine(path)
        e.share_prefixes = share
        res[f"grouped_plan_{share}"] = (
            e._shared_prefix_plan(
                gb["input_ids"][gb["attention_mask"].bool()],
                _cu_of(gb["attention_mask"]),
            )
            is not None
        )
        res[f"grouped_fwd_{share}"] = e.forward_batch(gb)
        res[f"grouped_stats_{share}"] = e.train_batch(gb, loss_fn, loss_weight_fn)
        res[f"grouped_params_{share}"] = full_params(e)
    res["grouped_ref"] = reference_logprobs(path, gb)

    # HF export of the trained engine, reloaded by transformers.
    from areal.api.io_struct import SaveLoadMeta

    hf_dir = os.path.join(out_dir, "hf1")
    eng.save(SaveLoadMeta(path=hf_dir, weight_format="hf"))
    res["fwd_after"] = eng.forward_batch(batch)
    res["hf_dir"] = hf_dir

    # Tied embeddings export: lm_head.weight dropped, reload gives the same logprobs.
    eng3 = make_engine(tied_path)
    eng3.hf_shard_mb = 0.1  # several shards + index
    tied_dir = os.path.join(out_dir, "hf_tied")
    eng3.save(SaveLoadMeta(path=tied_dir, weight_format="hf"))
    res["fwd_tied"] = eng3.forward_batch(batch)
    res["tied_dir"] = tied_dir

    # Critic: values per token, a training step runs and lowers the loss.
    crit = make_engine(path, critic=True, lr=1e-2)
    v0 = crit.forward_batch(batch)
    l0 = float(crit.eval_batch(batch, critic_loss_fn, loss_weight_fn))
    for _ in range(3):
        crit.train_batch(batch, critic_loss_fn, loss_weight_fn)
    l1 = float(crit.eval_batch(batch, critic_loss_fn, loss_weight_fn))
    res["critic"] = dict(
        shape=tuple(v0.shape),
        pad_zero=bool((v0[batch["attention_mask"] == 0] == 0).all()),
        l0=l0,
        l1=l1,
    )

    # Reference for the 2-rank session: whole batch, the same warm-up schedule (a fresh
    # engine from the same checkpoint; here rather than in a process of its own).
    warm = make_engine(path, lr_scheduler_type="cosine", warmup_steps_proportion=0.2, lr=2e-3)
    res["warmup"] = {
        "fwd": warm.forward_batch(batch),
        "stats": warm.train_batch(batch, loss_fn, loss_weight_fn),
        "params": full_params(warm),
    }
    return res


class FakeInferenceEngine:
    """Minimal inference side: forwards announced specs to a receiver process via queues."""

    def __init__(self, spec_q=None, ack_q=None):
        self.spec_q, self.ack_q = spec_q, ack_q
        self.disk_calls = []
        self.init_calls = 0

    def update_weights_from_disk(self, meta):
        self.disk_calls.append(meta.path)
        fut = Future()
        fut.set_result(None)
        return fut

    def init_weights_update_group(self, meta):
        self.init_calls += 1
        self.spec_q.put(("init", meta.master_port, meta.world_size, meta.group_name))
        fut = Future()
        fut.set_result(None)
        return fut

    def update_weights_from_distributed(self, meta, specs):
        self.spec_q.put(("bucket", [s.to_dict() for s in specs]))
        fut = Future()

        def wait_ack():
            try:
                fut.set_result(self.ack_q.get(timeout=120))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)

        threading.Thread(target=wait_ack, daemon=True).start()
        return fut


def _receiver(spec_q, ack_q, out_path):
    """Inference-side stand-in: joins the group as rank 1 and receives every bucket."""
    from areal.api.io_struct import ParamSpec
    from areal.utils.dist import broadcast_tensor, init_custom_process_group

    kind, port, world_size, name = spec_q.get(timeout=120)
    assert kind == "init"
    pg = init_custom_process_group("gloo", "127.0.0.1", port, world_size, 1, name)
    received, n_buckets = {}, 0
    while True:
        msg = spec_q.get(timeout=120)
        if msg[0] == "done":
            break
        n_buckets += 1
        for d in msg[1]:
            s = ParamSpec.from_dict(d)
            t = torch.empty(s.shape, dtype=getattr(torch, s.dtype))
            broadcast_tensor(pg, t, root=0)
            received[s.name] = t
        ack_q.put(len(msg[1]))
    torch.save(received, out_path)
    return n_buckets


def _two_rank_session(rank, world_size, path, out_dir, spec_q, ack_q, wu_port):
    from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
    from areal.utils.data import select_sequences

    full = make_batch()
    half = B // world_size
    batch = select_sequences(full, list(range(rank * half, (rank + 1) * half)), trim=False)
    res = {}
    eng = make_engine(path, lr_scheduler_type="cosine", warmup_steps_proportion=0.2, lr=2e-3)
    # warm-up 2 of 10 steps: the first step runs at lr * 0.5; compare with a 1-rank run below
    res["fwd"] = eng.forward_batch(batch)
    res["stats"] = eng.train_batch(batch, loss_fn, loss_weight_fn)
    if rank == 0:
        res["params"] = full_params(eng)
    else:
        full_params(eng)
    eng.step_lr_scheduler()

    # DCP checkpoint after step 1, step 2 uninterrupted, then resume in a fresh engine.
    ckpt = os.path.join(out_dir, "dcp")
    eng.save(SaveLoadMeta(path=ckpt, weight_format="dcp", with_optim=True))
    batch2 = select_sequences(
        make_batch(1), list(range(rank * half, (rank + 1) * half)), trim=False
    )
    res["stats_step2"] = eng.train_batch(batch2, loss_fn, loss_weight_fn)
    p2 = full_params(eng)
    eng.step_lr_scheduler()
    fresh = make_engine(path, lr_scheduler_type="cosine", warmup_steps_proportion=0.2, lr=2e-3)
    fresh.load(SaveLoadMeta(path=ckpt, weight_format="dcp", with_optim=True))
    res["stats_step2_resumed"] = fresh.train_batch(batch2, loss_fn, loss_weight_fn)
    p2r = full_params(fresh)
    if rank == 0:
        res["step2_params"] = p2
        res["resume_max_diff"] = max((p2[k] - p2r[k]).abs().max().item() for k in p2)
        res["resume_keys_equal"] = sorted(p2) == sorted(p2r)
    del fresh

    # Weight export: disk (fake engine) and xccl broadcast to the receiver process.
    fake = FakeInferenceEngine(spec_q, ack_q) if rank == 0 else None
    meta_disk = WeightUpdateMeta(type="disk", path=os.path.join(out_dir, "wu"), version=3)
    if fake is not None:
        eng.connect_engine(fake, meta_disk)
    res["version_before_disk"] = eng.get_version()
    eng.update_weights(meta_disk)
    res["version_after_disk"] = eng.get_version()
    if rank == 0:
        res["disk_calls"] = list(fake.disk_calls)
        res["export_params"] = full_params(eng)
    else:
        full_params(eng)
    meta_x = WeightUpdateMeta(
        type="xccl", master_port=wu_port, world_size=2, weight_chunked_mem_mb=1, version=4
    )
    eng.update_weights(meta_x)
    eng.update_weights(meta_x)  # second push reuses the group
    if rank == 0:
        res["n_specs"] = sum(len(b) for b in eng.get_param_specs(1))
        res["n_buckets"] = len(eng.get_param_specs(1))
        res["init_calls"] = fake.init_calls
        spec_q.put(("done",))

    # Bad input: clear errors on every rank (before any collective).
    errs = {}
    bad = {k: v for k, v in batch.items() if k != "attention_mask"}
    try:
        eng.train_batch(bad, loss_fn, loss_weight_fn)
    except ValueError as e:
        errs["no_mask"] = str(e)
    small = make_engine(path, max_tokens=20)
    try:
        small.train_batch(batch, loss_fn, loss_weight_fn)
    except ValueError as e:
        errs["too_long"] = str(e)
    # Only rank 1 has a sequence over the budget: both ranks raise, none hangs.
    short = select_sequences(full, [1, 3, 5, 7][rank * 2 : rank * 2 + 2], trim=False)  # lens <= 17
    mixed = short if rank == 0 else batch
    try:
        small.train_batch(mixed, loss_fn, loss_weight_fn)
    except ValueError as e:
        errs["one_rank_too_long"] = str(e)
    res["errors"] = errs
    return res


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from conftest import build_tiny_qwen2

    d = tmp_path_factory.mktemp("fsdp_models")
    return build_tiny_qwen2(str(d / "untied")), build_tiny_qwen2(str(d / "tied"), tie=True, seed=1)


@pytest.fixture(scope="module")
def one_rank(model_dirs, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one_rank"))
    return run_ranks(_one_rank_session, 1, (model_dirs[0], model_dirs[1], out), timeout=400)[0]


@pytest.fixture(scope="module")
def two_rank(model_dirs, tmp_path_factory):
    from _dist_helpers import free_port

    out = str(tmp_path_factory.mktemp("two_rank"))
    ctx = torch.multiprocessing.get_context("spawn")
    spec_q, ack_q = ctx.Queue(), ctx.Queue()
    recv_path = os.path.join(out, "received.pt")
    res = run_ranks(
        _two_rank_session,
        2,
        (model_dirs[0], out, spec_q, ack_q, free_port()),
        timeout=500,
        extra=[(_receiver, (spec_q, ack_q, recv_path))],
    )
    res["received"] = torch.load(recv_path)
    return res


@pytest.fixture(scope="module")
def one_rank_warmup(one_rank):
    """1 rank, whole batch, same schedule as the 2-rank session (for the equivalence test)."""
    return one_rank["warmup"]


# ----------------------------------------------------------------------------- tests
def test_forward_batch_packed_matches_padded_per_sequence(one_rank):
    mask = make_batch()["attention_mask"].bool()
    assert one_rank["fwd"].shape == (B, T)
    assert (one_rank["fwd"][~mask] == 0).all() and (one_rank["fwd"][:, 0] == 0).all()
    torch.testing.assert_close(one_rank["fwd"], one_rank["ref"], atol=ATOL, rtol=0)


def test_forward_batch_temperature_and_chunks_match_reference(one_rank):
    torch.testing.assert_close(one_rank["fwd_t07"], one_rank["ref_t07"], atol=ATOL, rtol=0)
    assert not torch.allclose(one_rank["fwd_t07"], one_rank["fwd"], atol=1e-3)
    torch.testing.assert_close(one_rank["fwd_chunked"], one_rank["fwd"], atol=ATOL, rtol=0)


def test_shared_prefix_layout_same_logprobs_loss_and_update_as_plain_packing(one_rank):
    assert one_rank["grouped_plan_True"] and not one_rank["grouped_plan_False"]
    on, off = one_rank["grouped_fwd_True"], one_rank["grouped_fwd_False"]
    torch.testing.assert_close(on, off, atol=ATOL, rtol=0)
    torch.testing.assert_close(on, one_rank["grouped_ref"], atol=ATOL, rtol=0)
    for k in ("loss", "grad_norm"):
        a, b = one_rank["grouped_stats_True"][k], one_rank["grouped_stats_False"][k]
        assert a == pytest.approx(b, abs=ATOL)
    for k, v in one_rank["grouped_params_False"].items():
        torch.testing.assert_close(one_rank["grouped_params_True"][k], v, atol=ATOL, rtol=0)


def test_train_batch_small_micro_batches_same_update(one_rank):
    assert one_rank["n_mbs_small"] >= 4
    for k in ("loss", "grad_norm", "lr"):
        assert one_rank["stats_small_mb"][k] == pytest.approx(one_rank["stats"][k], abs=ATOL)
    for k, v in one_rank["params"].items():
        torch.testing.assert_close(one_rank["params_small_mb"][k], v, atol=ATOL, rtol=0)


def test_train_batch_two_ranks_equal_one_rank(two_rank, one_rank_warmup):
    ref = one_rank_warmup
    for r in (0, 1):
        st = two_rank[r]["stats"]
        assert st["update_successful"] == 1.0
        for k in ("loss", "grad_norm", "lr"):
            assert st[k] == pytest.approx(ref["stats"][k], abs=ATOL), k
    assert ref["stats"]["lr"] == pytest.approx(1e-3)  # warm-up step 1 of 2
    assert ref["stats"]["grad_norm"] > 1.0  # clipping was active
    for k, v in ref["params"].items():
        torch.testing.assert_close(two_rank[0]["params"][k], v, atol=ATOL, rtol=0)
    # The export (after step 2) is the current weights, and step 2 moved EVERY tensor: an
    # export that silently sent step-1 (or partially stale) weights fails here.
    export, step2 = two_rank[0]["export_params"], two_rank[0]["step2_params"]
    assert sorted(export) == sorted(step2) == sorted(ref["params"])
    for k, v in step2.items():
        assert torch.equal(export[k], v), k
    unchanged = [k for k, v in ref["params"].items() if torch.equal(v, export[k])]
    assert not unchanged, unchanged
    # forward on each half equals the 1-rank forward of those rows
    both = torch.cat([two_rank[0]["fwd"], two_rank[1]["fwd"]])
    torch.testing.assert_close(both, one_rank_warmup["fwd"], atol=ATOL, rtol=0)


def test_hf_save_reload_by_transformers_gives_same_logprobs(one_rank):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(one_rank["hf_dir"], "model.safetensors"))
    for k, v in one_rank["params"].items():
        assert torch.equal(sd[k], v), k
    ref = reference_logprobs(one_rank["hf_dir"], make_batch())
    torch.testing.assert_close(ref, one_rank["fwd_after"], atol=ATOL, rtol=0)


def test_hf_save_tied_embeddings_drops_lm_head(one_rank):
    from safetensors.torch import load_file

    with open(os.path.join(one_rank["tied_dir"], "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 1 and not os.path.exists(
        os.path.join(one_rank["tied_dir"], "model.safetensors")
    )
    sd = {}
    for fn in files:
        sd.update(load_file(os.path.join(one_rank["tied_dir"], fn)))
    assert sorted(sd) == sorted(weight_map)
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    ref = reference_logprobs(one_rank["tied_dir"], make_batch())
    torch.testing.assert_close(ref, one_rank["fwd_tied"], atol=ATOL, rtol=0)


def test_dcp_resume_next_step_identical(two_rank):
    r0 = two_rank[0]
    assert r0["resume_keys_equal"]
    assert r0["resume_max_diff"] <= ATOL
    for k in ("loss", "grad_norm", "lr"):
        assert r0["stats_step2_resumed"][k] == pytest.approx(r0["stats_step2"][k], abs=ATOL), k
    assert r0["stats_step2"]["lr"] == pytest.approx(2e-3)  # scheduler state was restored


def test_update_weights_xccl_receiver_gets_every_tensor_exactly(two_rank):
    sent = two_rank[0]["export_params"]
    got = two_rank["received"]
    assert sorted(got) == sorted(sent)
    assert len(got) == two_rank[0]["n_specs"]
    for k, v in sent.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert two_rank["extra"][0] == 2 * two_rank[0]["n_buckets"]  # two pushes, every bucket acked
    assert two_rank[0]["init_calls"] == 1


def test_update_weights_disk_writes_hf_and_notifies_engine(two_rank, tmp_path):
    r0 = two_rank[0]
    assert len(r0["disk_calls"]) == 1
    from safetensors.torch import load_file

    sd = load_file(os.path.join(r0["disk_calls"][0], "model.safetensors"))
    for k, v in r0["export_params"].items():
        assert torch.equal(sd[k], v), k
    # moves weights only: the version is committed by WeightSynchronizer, not the push
    assert r0["version_after_disk"] == r0["version_before_disk"] != 3


def test_train_batch_bad_input_clear_errors(two_rank):
    for r in (0, 1):
        errs = two_rank[r]["errors"]
        assert "attention_mask" in errs["no_mask"]
        assert "max_tokens_per_mb=20" in errs["too_long"]
    assert "another data-parallel rank rejected" in two_rank[0]["errors"]["one_rank_too_long"]
    assert "max_tokens_per_mb=20" in two_rank[1]["errors"]["one_rank_too_long"]


def test_critic_values_shape_and_training_lowers_loss(one_rank):
    c = one_rank["critic"]
    assert c["shape"] == (B, T) and c["pad_zero"]
    assert c["l1"] < c["l0"]


def test_initialize_missing_model_path_raises(tmp_path):
    from areal.engine.fsdp_engine import FSDPEngine

    eng = FSDPEngine(make_config(str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="nope"):
        eng.initialize(None, None)


def test_bucket_param_specs_limit_respected_order_kept():
    from areal.api.io_struct import ParamSpec
    from areal.engine.fsdp_engine import bucket_param_specs

    specs = [ParamSpec(f"p{i}", (n,), "float32") for i, n in enumerate([10, 20, 5, 100, 1, 1])]
    buckets = bucket_param_specs(specs, limit_bytes=30 * 4)
    assert [[s.name for s in b] for b in buckets] == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"]]
    with pytest.raises(ValueError, match="limit_bytes"):
        bucket_param_specs(specs, 0)


def test_write_safetensors_roundtrip_all_dtypes(tmp_path):
    from safetensors.torch import load_file

    from areal.engine.fsdp_engine import write_safetensors

    sd = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.zeros(0),
        "e": torch.tensor([True, False]),
    }
    write_safetensors(sd, str(tmp_path / "x.safetensors"))
    back = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    with pytest.raises(ValueError, match="complex"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "z"))
