"""Tests of AllocationMode parsing."""

from __future__ import annotations

import pytest

from areal.api.alloc_mode import AllocationMode, AllocationType, ModelAllocation, ParallelStrategy


def test_local_plus_fsdp_parses_sizes():
    mode = AllocationMode.from_str("local:d1+fsdp:d2")
    assert mode.type_ is AllocationType.DECOUPLED_TRAIN
    assert (mode.gen_backend, mode.train_backend) == ("local", "fsdp")
    assert mode.gen_world_size == 1 and mode.train_world_size == 2 and mode.world_size == 3


def test_sglang_with_tp_parses_instance_size():
    mode = AllocationMode.from_str("sglang:d4p1t2+fsdp:d4")
    assert (mode.gen.dp_size, mode.gen.pp_size, mode.gen.tp_size) == (4, 1, 2)
    assert mode.gen_instance_size == 2 and mode.gen_n_instances == 4
    assert mode.gen_world_size == 8 and mode.train_world_size == 4 and mode.world_size == 12


def test_vllm_with_train_tensor_parallel():
    mode = AllocationMode.from_str("vllm:d2+archon:d2t2")
    assert mode.gen_backend == "vllm" and mode.train.tp_size == 2 and mode.train_world_size == 4


def test_dot_separator_equals_colon_separator():
    a = AllocationMode.from_str("sglang.d4+fsdp.d4")
    b = AllocationMode.from_str("sglang:d4+fsdp:d4")
    assert a.allocations == b.allocations and a.type_ is b.type_


def test_bare_training_dims_default_to_fsdp():
    mode = AllocationMode.from_str("sglang:d4p1t1+d4p1t1")
    assert mode.train_backend == "fsdp" and mode.train_world_size == 4
    only_train = AllocationMode.from_str("d2")
    assert only_train.type_ is AllocationType.COLOCATE and only_train.gen is None
    assert only_train.train_world_size == 2 and only_train.gen_world_size == 0


def test_inference_only_and_colocation():
    assert AllocationMode.from_str("vllm:d2").type_ is AllocationType.LLM_SERVER_ONLY
    colo = AllocationMode.from_str("vllm:d2|fsdp:d2")
    assert colo.type_ is AllocationType.COLOCATE and colo.world_size == 2


def test_named_components_lookup():
    mode = AllocationMode.from_str("vllm[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d2")
    assert mode["actor"].parallel.dp_size == 4 and mode["critic"].world_size == 2
    assert mode.train_backend == "fsdp" and mode.train_world_size == 4
    with pytest.raises(KeyError, match="ref"):
        mode["ref"]


def test_str_round_trips():
    mode = AllocationMode.from_str("sglang:d4t2+fsdp:d4")
    assert AllocationMode.from_str(str(mode)).allocations == mode.allocations


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("tpu:d4+fsdp:d4", "unknown backend 'tpu'"),
        ("sglang:d4+fsdp:d0", "must be >= 1"),
        ("sglang:d4d2+fsdp:d4", "repeated"),
        ("sglang:d4x2+fsdp:d4", "unknown parallel dimension 'x'"),
        ("sglang:+fsdp:d4", "empty parallel dimensions"),
        ("sglang:d4+fsdp:four", "cannot parse"),
        ("vllm:d2+sglang:d2", "inference components"),
        ("vllm:d2+fsdp:d2+fsdp:d2", "distinct names"),
        ("vllm:d2|fsdp:d4", "same number of devices"),
        ("vllm:d2|fsdp:d2+fsdp:d2", "mixing"),
    ],
)
def test_malformed_allocation_raises_valueerror_naming_string(text, fragment):
    with pytest.raises(ValueError) as info:
        AllocationMode.from_str(text)
    msg = str(info.value)
    assert fragment in msg
    if text:
        assert repr(text) in msg


def test_unknown_backend_error_lists_allowed():
    with pytest.raises(ValueError) as info:
        AllocationMode.from_str("jax:d2")
    assert "local" in str(info.value) and "fsdp" in str(info.value)


def test_parse_backend_requires_single_prefixed_component():
    alloc = ParallelStrategy.parse_backend("archon:d2t2")
    assert isinstance(alloc, ModelAllocation) and alloc.world_size == 4
    with pytest.raises(ValueError, match="backend prefix"):
        ParallelStrategy.parse_backend("d2")
    with pytest.raises(ValueError, match="allocation_mode"):
        ParallelStrategy.parse_backend("vllm:d1+fsdp:d1")


def test_parallel_strategy_rejects_zero():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelStrategy(tensor_parallel_size=0)


def test_model_allocation_from_str_with_name_as_areal():
    from areal.api.alloc_mode import FSDPParallelStrategy, ModelAllocation
    from areal.api.cli_args import SchedulingStrategy

    a = ModelAllocation.from_str("sglang:d4t2", name="rollout")
    assert (a.backend, a.name, a.parallel.dp_size, a.parallel.tp_size) == (
        "sglang",
        "rollout",
        4,
        2,
    )
    assert a.world_size == 8 and a.scheduling_strategy is None
    # the name argument wins over a name in the spec
    assert ModelAllocation.from_str("fsdp[critic]:d2", name="actor").name == "actor"
    co = ModelAllocation.from_str(
        "fsdp:d2",
        name="ref",
        scheduling_strategy=SchedulingStrategy(type="colocation", target="actor"),
    )
    assert co.world_size == 0  # colocated: no devices of its own
    with pytest.raises(ValueError, match="one component"):
        ModelAllocation.from_str("sglang:d2+fsdp:d2")
    assert isinstance(FSDPParallelStrategy(data_parallel_size=2).dp_size, int)
