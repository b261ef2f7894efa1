"""Padded <-> packed tensor dicts and micro-batch splitting."""

from __future__ import annotations

import pytest
import torch

from areal.api.cli_args import MicroBatchSpec
from areal.utils.data import (
    concat_padded_tensors,
    pack_tensor_dict,
    pad_packed_tensor,
    split_padded_tensor_dict_into_mb_list,
    unpack_sequence,
    validate_padded_batch,
)


def _batch(lens=(5, 2, 7, 3), t=8):
    b = len(lens)
    lens_t = torch.tensor(lens)
    mask = (torch.arange(t)[None, :] < lens_t[:, None]).long()
    ids = (torch.arange(b * t).view(b, t) + 10) * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "logprobs": ids.float() * 0.5,
        "rewards": torch.arange(b, dtype=torch.float32),
        "feat": torch.ones(b, t, 3) * mask[..., None],
    }


def test_pack_tensor_dict_drops_padding_and_restarts_positions():
    d = _batch()
    p = pack_tensor_dict(d)
    assert p["cu_seqlens"].dtype == torch.int32
    assert p["cu_seqlens"].tolist() == [0, 5, 7, 14, 17]
    assert p["max_seqlen"] == 7
    assert p["input_ids"].shape == (17,) and p["feat"].shape == (17, 3)
    assert p["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert torch.equal(p["rewards"], d["rewards"])
    assert "attention_mask" not in p
    assert p["input_ids"][:5].tolist() == d["input_ids"][0, :5].tolist()


def test_pad_packed_tensor_roundtrip_restores_padded():
    d = _batch()
    p = pack_tensor_dict(d)
    back = pad_packed_tensor(p["logprobs"], p["cu_seqlens"], max_len=8)
    assert torch.equal(back, d["logprobs"])
    seqs = unpack_sequence(p["input_ids"], p["cu_seqlens"])
    assert [len(s) for s in seqs] == [5, 2, 7, 3]


def test_validate_padded_batch_bad_inputs_raise_named_errors():
    d = _batch()
    with pytest.raises(ValueError, match="attention_mask"):
        validate_padded_batch({"input_ids": d["input_ids"]})
    left = dict(d, attention_mask=d["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="right-padded"):
        validate_padded_batch(left)
    with pytest.raises(ValueError, match="input_ids"):
        validate_padded_batch(dict(d, input_ids=d["input_ids"][:, :3]))


def test_split_mb_list_under_budget_and_order_restorable():
    d = _batch(lens=(5, 2, 7, 3, 6, 1), t=8)
    mbl = split_padded_tensor_dict_into_mb_list(d, MicroBatchSpec(max_tokens_per_mb=8))
    assert all(c <= 8 for c in mbl.mb_token_counts)
    assert sum(mbl.mb_token_counts) == 24
    packed = [pack_tensor_dict(mb) for mb in mbl.mbs]
    seqs = [s for p in packed for s in unpack_sequence(p["input_ids"], p["cu_seqlens"])]
    ordered = [seqs[i] for i in mbl.backward_indices.tolist()]
    lens = d["attention_mask"].sum(1).tolist()
    for b, s in enumerate(ordered):
        assert s.tolist() == d["input_ids"][b, : lens[b]].tolist()
    # per-sequence keys follow their rows
    rewards = torch.cat([mb["rewards"] for mb in mbl.mbs])[mbl.backward_indices]
    assert torch.equal(rewards, d["rewards"])


def test_split_mb_list_n_mbs_and_granularity_respected():
    d = _batch(lens=(5, 2, 7, 3, 6, 1), t=8)
    mbl = split_padded_tensor_dict_into_mb_list(d, MicroBatchSpec(n_mbs=3, granularity=2))
    assert len(mbl) == 3
    for g in mbl.group_indices:
        assert len(g) % 2 == 0 and all(g[i] // 2 == g[i + 1] // 2 for i in range(0, len(g), 2))


def test_split_mb_list_sequence_longer_than_budget_raises():
    with pytest.raises(ValueError, match="max_tokens_per_mb=4"):
        split_padded_tensor_dict_into_mb_list(_batch(), MicroBatchSpec(max_tokens_per_mb=4))


def test_concat_padded_tensors_pads_to_longest():
    a, b = _batch(lens=(2, 3), t=3), _batch(lens=(5,), t=5)
    c = concat_padded_tensors([a, b])
    assert c["input_ids"].shape == (3, 5) and c["feat"].shape == (3, 5, 3)
    assert c["attention_mask"].sum().item() == 10
