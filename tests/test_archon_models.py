"""Archon model families against transformers (one process, no process group): logits
of a packed batch equal transformers' per-sequence logits (fp32, atol 1e-5), the
state-dict adapter round-trips every HF name, the registry takes a user's family and
refuses a taken model_type, AReaL's import paths resolve."""

from __future__ import annotations

import pytest
import torch

ATOL = 1e-5


def _hf_model(family: str, tie: bool = False, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    with torch.no_grad():  # away from the near-identity default init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _archon_model(hf_model):
    from areal.models.archon import get_model_spec

    spec = get_model_spec(hf_model.config.model_type)
    args = spec.model_args_class.from_hf_config(hf_model.config)
    model = spec.model_class(args)
    adapter = spec.state_dict_adapter_class(args)
    model.load_state_dict(adapter.from_hf(hf_model.state_dict()), strict=True)
    return model.eval(), adapter


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_packed_logits_equal_transformers_per_sequence(family, tie):
    hf = _hf_model(family, tie=tie)
    ours, _ = _archon_model(hf)
    g = torch.Generator().manual_seed(1)
    lens = [7, 13, 1, 20]
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in lens]
    tokens = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    with torch.no_grad():
        got = ours(tokens, positions, cu)
        want = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
    assert got.shape == want.shape == (sum(lens), 96)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_state_dict_adapter_round_trips_every_hf_name(family):
    hf = _hf_model(family)
    _, adapter = _archon_model(hf)
    sd = hf.state_dict()
    back = adapter.to_hf(adapter.from_hf(sd))
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    with pytest.raises(KeyError, match="no engine name"):
        adapter.from_hf({"model.layers.0.self_attn.unknown.weight": torch.zeros(1)})


def test_qwen3_has_qk_norms_and_qwen2_qkv_biases():
    q2, _ = _archon_model(_hf_model("qwen2"))
    q3, _ = _archon_model(_hf_model("qwen3"))
    att2, att3 = q2.layers["0"].attention, q3.layers["0"].attention
    assert att2.wq.bias is not None and att2.q_norm is None and att2.wo.bias is None
    assert att3.wq.bias is None and att3.q_norm is not None and att3.k_norm is not None


def test_registry_takes_a_user_family_and_refuses_a_taken_type():
    from areal.models.archon import (
        ModelSpec,
        get_model_spec,
        get_supported_model_types,
        is_supported_model,
        register_model_spec,
    )
    from areal.models.archon.qwen2 import (
        Qwen2Model,
        Qwen2ModelArgs,
        Qwen2StateDictAdapter,
        parallelize_qwen2,
    )

    assert {"qwen2", "qwen3"} <= get_supported_model_types()
    mine = ModelSpec(
        name="my_llama_like",
        model_class=Qwen2Model,
        model_args_class=Qwen2ModelArgs,
        state_dict_adapter_class=Qwen2StateDictAdapter,
        parallelize_fn=parallelize_qwen2,
        supported_model_types=frozenset({"my_llama_like_test"}),
    )
    assert register_model_spec(mine) is mine
    assert is_supported_model("my_llama_like_test") and get_model_spec("my_llama_like_test") is mine
    with pytest.raises(ValueError, match="already registered by archon family 'qwen2'"):
        register_model_spec(
            ModelSpec(
                name="other",
                model_class=Qwen2Model,
                model_args_class=Qwen2ModelArgs,
                state_dict_adapter_class=Qwen2StateDictAdapter,
                parallelize_fn=parallelize_qwen2,
                supported_model_types=frozenset({"qwen2"}),
            )
        )
    with pytest.raises(ValueError, match="no archon model family"):
        get_model_spec("llama_not_here")


def test_areal_import_paths_resolve():
    from areal.engine.archon import ArchonEngine as Engine
    from areal.experimental.engine.archon_engine import ArchonEngine
    from areal.experimental.models.archon import ArchonParallelDims as A
    from areal.experimental.models.archon import get_model_spec
    from areal.experimental.models.archon.parallel_dims import ArchonParallelDims as B
    from areal.trainer.archon_hosts import (
        ArchonDPOEngine,
        ArchonLMEngine,
        ArchonPPOActor,
        ArchonPPOCritic,
        ArchonRWEngine,
    )

    assert A is B and ArchonEngine is Engine
    assert get_model_spec("qwen3").name == "qwen3"
    for cls in (ArchonPPOActor, ArchonPPOCritic, ArchonLMEngine, ArchonRWEngine, ArchonDPOEngine):
        assert issubclass(cls, ArchonEngine)
