"""Delta weight transfer's encoding (``areal.infra.weights.delta``) on hand-built tensors:
sparse / mask / dense / unchanged choice, int32 indices, bf16 values bit-exact, the round trip
through the files, the refusals (base version, dtype, names, shapes), the config fields."""

from __future__ import annotations

import json
import os

import pytest
import torch

from areal.infra.weights.delta import (
    DeltaRefused,
    apply_delta,
    apply_entries,
    check_delta,
    encode_tensor,
    index_dtype,
    read_manifest,
    unpack_mask,
    write_delta,
)


def _pair():
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(40, 25, generator=g) * 0.02).to(torch.bfloat16)
    sparse_new = base.clone()
    flat = sparse_new.view(-1)
    flat[[3, 17, 999]] = torch.tensor([0.5, -0.25, 1.0], dtype=torch.bfloat16)
    dense_new = (base.float() + 0.01).to(torch.bfloat16)  # ~every element changes
    mask_new = base.clone()
    mask_new.view(-1)[::10] += 0.5  # 10% changed: one bit per element beats int32 positions
    return base, sparse_new, dense_new, mask_new


def test_weight_delta_encode_sparse_mask_dense_unchanged_int32_indices_bf16_values_exact():
    base, sparse_new, dense_new, mask_new = _pair()
    mode, parts, k = encode_tensor(sparse_new, base)
    assert (mode, k) == ("sparse", 3)
    assert parts["idx"].dtype == torch.int32 and parts["idx"].tolist() == [3, 17, 999]
    assert parts["val"].dtype == torch.bfloat16
    assert parts["val"].tolist() == [0.5, -0.25, 1.0]
    mode, parts, k = encode_tensor(dense_new, base)
    assert mode == "dense" and k > 1000 * 6 // 8  # sparse would not be smaller
    assert torch.equal(parts["dense"].view(base.shape), dense_new)
    mode, parts, k = encode_tensor(mask_new, base)
    assert (mode, k) == ("mask", 100) and parts["mask"].dtype == torch.uint8
    assert parts["mask"].numel() == 125 and parts["mask"][0] == 0b00000001
    assert torch.equal(
        unpack_mask(parts["mask"], 1000).nonzero().view(-1), torch.arange(0, 1000, 10)
    )
    assert torch.equal(parts["val"], mask_new.view(-1)[::10])
    assert encode_tensor(base.clone(), base) == ("unchanged", {}, 0)
    # bit-exact comparison: -0.0 differs from 0.0
    z = torch.zeros(8, dtype=torch.bfloat16)
    assert encode_tensor(-z, z)[2] == 8
    assert index_dtype(2**31 - 1) is torch.int32 and index_dtype(2**31) is torch.int64
    with pytest.raises(ValueError, match="delta of"):
        encode_tensor(base.float(), base)


def test_weight_delta_files_round_trip_exact_manifest_counts_and_refusals(tmp_path):
    base, sparse_new, dense_new, mask_new = _pair()
    same = torch.arange(10, dtype=torch.bfloat16)
    pairs = [("a.weight", sparse_new, base), ("b.weight", dense_new, base), ("c", same, same)]
    pairs.append(("d.weight", mask_new, base))
    m = write_delta(str(tmp_path), pairs, base_version=4, version=5, dtype="bfloat16")
    names = ("a.weight", "b.weight", "c", "d.weight")
    assert [m["tensors"][n]["mode"] for n in names] == ["sparse", "dense", "unchanged", "mask"]
    assert m["tensors"]["a.weight"]["bytes"] == 3 * (4 + 2)
    assert m["tensors"]["d.weight"]["bytes"] == 125 + 100 * 2
    assert m["totals"]["bytes"] == 3 * 6 + 1000 * 2 + 125 + 200
    assert m["totals"]["dense_bytes"] == 3 * 1000 * 2 + 10 * 2
    assert read_manifest(str(tmp_path)) == json.loads(json.dumps(m))
    targets = {n: base.clone() for n in names}
    targets["c"] = same.clone()
    check_delta(m, 4, torch.bfloat16)
    assert apply_delta(str(tmp_path), targets, m) == 3
    for name, new, _ in pairs:
        assert torch.equal(targets[name], new), name
    # the trainer's kept copy moves the same way (apply_entries on encode_tensor's parts)
    kept = {n: b.clone() for n, _, b in pairs}
    apply_entries(kept, {n: encode_tensor(new, b)[:2] for n, new, b in pairs})
    for name, new, _ in pairs:
        assert torch.equal(kept[name], new), name
    with pytest.raises(DeltaRefused, match="base version 4; this server holds version 5"):
        check_delta(m, 5, torch.bfloat16)
    with pytest.raises(DeltaRefused, match="dtype 'bfloat16'.*'float32'"):
        check_delta(m, 4, torch.float32)
    with pytest.raises(DeltaRefused, match="does not have"):
        apply_delta(str(tmp_path), {"a.weight": base.clone()}, m)
    bad = {n: base.clone() for n in names}
    bad["b.weight"] = torch.zeros(3)
    with pytest.raises(DeltaRefused, match="shape"):
        apply_delta(str(tmp_path), bad, m)
    assert torch.equal(bad["a.weight"], base)  # checked before anything is written
    os.remove(tmp_path / "manifest.json")
    with pytest.raises(DeltaRefused, match="no delta manifest"):
        read_manifest(str(tmp_path))


def test_weight_delta_config_fields_adamw_only_anchor_non_negative_acted_on():
    from areal.api.cli_args import TrainEngineConfig
    from areal.api.experiment_config import NOT_ACTED_ON
    from areal.api.io_struct import WeightUpdateMeta

    with pytest.raises(ValueError, match="weight_update_delta_method='sgd'.*adamw"):
        TrainEngineConfig(weight_update_delta_method="sgd")
    with pytest.raises(ValueError, match="weight_update_anchor_interval"):
        TrainEngineConfig(weight_update_anchor_interval=-1)
    fields = {f for _, f, _ in NOT_ACTED_ON}
    assert not fields & {
        "enable_delta_weight_update",
        "weight_update_delta_method",
        "weight_update_anchor_interval",
    }
    with pytest.raises(ValueError, match="delta needs type='disk'"):
        WeightUpdateMeta(type="xccl", delta=True)
    with pytest.raises(ValueError, match="delta_anchor_interval"):
        WeightUpdateMeta(type="disk", path="/x", delta=True, delta_anchor_interval=-2)
    meta = WeightUpdateMeta(type="disk", path="/x", delta=True, delta_anchor_interval=2)
    assert meta.with_version(3).delta and meta.with_version(3).delta_anchor_interval == 2


def test_weight_delta_transport_full_for_backends_without_route_and_xccl_lora_keep_full(caplog):
    from types import SimpleNamespace

    from areal.api.cli_args import InferenceEngineConfig, TrainEngineConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.inference.clients.sglang import RemoteSGLangEngine
    from areal.inference.clients.vllm import RemotevLLMEngine
    from areal.infra.weights.transports import (
        DeltaTransport,
        DiskTransport,
        transport_for,
        with_delta,
    )

    cfg = InferenceEngineConfig()
    assert RemoteLocalEngine(cfg).supports_weight_delta()
    vllm, sglang = RemotevLLMEngine(cfg), RemoteSGLangEngine(cfg)
    assert not vllm.supports_weight_delta() and not sglang.supports_weight_delta()
    meta = WeightUpdateMeta(type="disk", path="/x/v1", delta=True, version=1)
    ctx = SimpleNamespace(rollout=vllm, actor=None, meta=meta, version=1, previous_version=0)
    with caplog.at_level("WARNING"):
        assert DeltaTransport()._why_full(ctx) == "backend"
        assert DeltaTransport()._why_full(ctx) == "backend"
    said = [r for r in caplog.records if "not available for the 'vllm'" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)
    assert isinstance(transport_for(meta), DeltaTransport)
    assert type(transport_for(WeightUpdateMeta(type="disk", path="/x"))) is DiskTransport

    actor = TrainEngineConfig(
        enable_delta_weight_update=True, dtype="bfloat16", weight_update_anchor_interval=4
    )
    disk = with_delta(WeightUpdateMeta(type="disk", path="/x"), actor)
    assert (disk.delta, disk.delta_dtype, disk.delta_anchor_interval) == (True, "bfloat16", 4)
    xccl = WeightUpdateMeta(type="xccl")
    assert with_delta(xccl, actor) is xccl  # the full broadcast, logged once
    actor.use_lora = True
    assert not with_delta(WeightUpdateMeta(type="disk", path="/x"), actor).delta
    actor.use_lora, actor.enable_delta_weight_update = False, False
    assert not with_delta(WeightUpdateMeta(type="disk", path="/x"), actor).delta
