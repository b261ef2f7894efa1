"""Layouts and archon options this project cannot run are refused when the config or
allocation is parsed (before any process starts), each error naming the dimension or
field and the allowed values; 'megatron:' and model-parallel 'fsdp:' layouts (AReaL 2.0
YAMLs) run on archon instead."""

from __future__ import annotations

import pytest

from areal.api.alloc_mode import AllocationMode, ParallelStrategy


@pytest.mark.parametrize(
    ("text", "dims"),
    [
        ("fsdp:d2t2", "d2t2"),
        ("local:d1+fsdp:d2c2", "d2c2"),
        ("vllm:d2+fsdp:d2e2", "d2e2"),
        ("fsdp:d1p2", "d1p2"),
        ("d2t2", "d2t2"),  # a bare training component is FSDP
        ("megatron:d4", "d4"),
        ("local:d1+megatron:d2t2", "d2t2"),
        ("vllm:d2|megatron:d2", "d2"),
    ],
)
def test_fsdp_model_parallel_dims_and_megatron_run_on_archon(text, dims):
    """AReaL 2.0 YAMLs: 'megatron:' and 'fsdp:' with t/c/p/e run on the parallel engine
    (same dimensions), logged, instead of being refused."""
    mode = AllocationMode.from_str(text)
    assert mode.train_backend == "archon" and str(mode.train) == dims


def test_mapping_is_logged_naming_both_backends(caplog):
    import logging

    caplog.set_level(logging.WARNING)
    logging.getLogger("CLIArgs").addHandler(caplog.handler)
    try:
        AllocationMode.from_str("local:d1+fsdp:d1c7")  # a layout no other test logs
        AllocationMode.from_str("local:d1+megatron:d1t7")
    finally:
        logging.getLogger("CLIArgs").removeHandler(caplog.handler)
    assert "'fsdp:d1c7' runs on the parallel engine as 'archon:d1c7'" in caplog.text
    assert "'megatron:d1t7' runs on the parallel engine as 'archon:d1t7'" in caplog.text
    assert "no Megatron-LM engine" in caplog.text
    # the hybrid MoE form on fsdp (or bare) runs on archon as well
    assert AllocationMode.from_str("fsdp:(attn:d2t2|ffn:d2e2)").train_backend == "archon"


def test_backend_fields_mapped_too():
    from areal.api.cli_args import TrainEngineConfig

    assert ParallelStrategy.parse_backend("fsdp:d2t2").backend == "archon"
    assert ParallelStrategy.parse_backend("megatron:d2").backend == "archon"
    assert ParallelStrategy.parse_backend("fsdp:d2").backend == "fsdp"
    TrainEngineConfig(backend="fsdp:d1t2")
    TrainEngineConfig(backend="megatron:d2")
    # what archon cannot build is still refused, by name
    with pytest.raises(ValueError, match="expert parallelism e3"):
        AllocationMode.from_str("megatron:d4e3")


def test_archon_pipeline_layouts_parse():
    mode = AllocationMode.from_str("local:d1+archon:d2p2")
    assert mode.train_backend == "archon" and mode.train_world_size == 4
    assert mode.train.pp_size == 2 and mode.train.dp_size == 2
    assert ParallelStrategy.parse_backend("archon:p2t2").world_size == 4


def test_archon_layouts_parse():
    mode = AllocationMode.from_str("local:d1+archon:d2t2")
    assert mode.train_backend == "archon" and mode.train_world_size == 4
    assert mode.train.dp_size == 2 and mode.train.tp_size == 2
    assert ParallelStrategy.parse_backend("archon:d1c2").world_size == 2


@pytest.mark.parametrize(
    "text",
    [
        "archon:(attn:d2t2|ffn:d2e2)",
        "local:d1+archon:(attn:d2t2|ffn:d2e2)",
        "local:d1+archon:attn:d2t2|ffn:e2",  # AReaL: parentheses optional, ffn d derived
        "local:d4|archon:(attn:d2t2|ffn:d2e2)",  # colocated: '|' inside parentheses is not
    ],
)
def test_archon_hybrid_moe_form_parses_and_round_trips(text):
    mode = AllocationMode.from_str(text)
    ps = mode.train
    assert mode.train_backend == "archon" and mode.train_world_size == 4
    assert (ps.dp_size, ps.tp_size, ps.ep_size, ps.etp_size) == (2, 2, 2, 1)
    assert ps.hybrid_moe and ps.expert_data_parallel_size == 2
    assert str(ps) == "(attn:d2t2|ffn:d2e2)"
    again = ParallelStrategy.parse_backend(f"archon:{ps}")  # engine_select writes this back
    assert again.parallel == ps and again.backend == "archon"
    assert mode.gen_backend == ("local" if "local" in text else None)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("archon:(attn:d2t2|ffn:d2e4)", "attn d2*t2*p1*c1 = 4, ffn d2*e4*t1*p1 = 8"),
        ("archon:(attn:d2p2|ffn:d2e2p1)", "ffn p1 differs from attn p2"),
        ("archon:(attn:d3t2|ffn:e4)", "cannot derive ffn d: the attn world size 6"),
        ("archon:(attn:d2t2e2|ffn:d2e2)", "unknown parallel dimension 'e' in the attn section"),
        ("archon:(attn:d2t2|ffn:c2e2)", "unknown parallel dimension 'c' in the ffn section"),
        ("archon:(attn:d2t4|ffn:d4t2)", "ffn t2 must equal attn t4"),
        ("archon:(attn:d4t2|ffn:d2e2t2)", "ffn e2 with ffn t2: the experts are split over all"),
        ("archon:(attn:d2t2c2|ffn:d2e2t2)", "allowed ffn e: [1]"),
        ("archon:(attn:d1t4|ffn:d2e2)", "ffn e2 must be a multiple of attn c*t = 4"),
        ("archon:(attn:d2t2|ffn:d2e2", "unbalanced '('"),
        ("archon:(attn:d2t2)", "the MoE hybrid form is '(attn:"),
    ],
)
def test_archon_hybrid_moe_form_refusals_name_the_part(text, fragment):
    with pytest.raises(ValueError) as info:
        AllocationMode.from_str(text)
    assert fragment in str(info.value) and repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("archon:(attn:t2|ffn:t2)", (1, 2, 1, 2, 1)),
        ("archon:(attn:d2t2|ffn:e2t2)", (2, 2, 2, 2, 1)),
    ],
)
def test_archon_hybrid_expert_tensor_parallel_parses_and_round_trips(text, sizes):
    # ffn t = attn t: each expert's hidden dimension split over the tensor ranks
    ps = ParallelStrategy.parse_backend(text).parallel
    got = (ps.dp_size, ps.tp_size, ps.ep_size, ps.etp_size, ps.expert_data_parallel_size)
    assert got == sizes and ps.hybrid_moe
    assert ParallelStrategy.parse_backend(f"archon:{ps}").parallel == ps


def test_parallel_dims_hybrid_mesh_sizes():
    from areal.models.archon import ArchonParallelDims

    dims = ArchonParallelDims(dp_shard=2, tp=2, ep=2, world_size=4, ep_spans_cp_tp=True)
    assert dims.efsdp == 2  # the hybrid form's ffn d
    dims = ArchonParallelDims(dp_shard=2, tp=2, cp=2, ep=8, world_size=8, ep_spans_cp_tp=True)
    assert dims.efsdp == 1
    with pytest.raises(ValueError, match=r"ep=2 \(hybrid form: ep takes the cp\*tp=4"):
        ArchonParallelDims(dp_shard=2, tp=2, cp=2, ep=2, world_size=8, ep_spans_cp_tp=True)
    with pytest.raises(ValueError, match=r"etp=2 with ep_spans_cp_tp=True"):
        ArchonParallelDims(dp_shard=2, tp=2, ep=2, etp=2, world_size=4, ep_spans_cp_tp=True)
    with pytest.raises(ValueError, match=r"cannot also be FSDP-sharded \(dp_shard/ep\*cp = 2\)"):
        ArchonParallelDims(dp_shard=4, tp=2, ep=2, etp=2, world_size=8)


class _Cfg:
    def __init__(self, heads=4, kv=2, experts=0, tie=False, layers=2):
        self.num_hidden_layers = layers
        self.num_attention_heads = heads
        self.num_key_value_heads = kv
        self.num_experts = experts
        self.tie_word_embeddings = tie
        self.model_type = "qwen2"


def test_check_layout_names_dimension_and_allowed_values():
    from areal.models.archon import check_layout

    check_layout(_Cfg(), tp=2, cp=2)
    with pytest.raises(
        ValueError, match=r"t3 does not divide the 4 attention heads.*allowed t: \[1, 2, 4\]"
    ):
        check_layout(_Cfg(), tp=3)
    with pytest.raises(
        ValueError, match=r"t4 does not divide the 2 key/value heads.*allowed t: \[1, 2\]"
    ):
        check_layout(_Cfg(), tp=4)
    with pytest.raises(
        ValueError, match=r"c4 does not divide the 2 attention heads per.*allowed c: \[1, 2\]"
    ):
        check_layout(_Cfg(), tp=2, cp=4)
    with pytest.raises(
        ValueError, match=r"e2 needs a mixture-of-experts model.*dense.*allowed e: \[1\]"
    ):
        check_layout(_Cfg(), ep=2)
    with pytest.raises(ValueError, match=r"tied embeddings.*allowed p: \[1\]"):
        check_layout(_Cfg(tie=True), pp=2)
    check_layout(_Cfg(), pp=2, tp=2)
    # pipeline stages of a mixture-of-experts model (with expert parallelism too) and
    # with context parallelism are layouts of their own, no longer refused
    check_layout(_Cfg(experts=4), pp=2, ep=2)
    check_layout(_Cfg(), pp=2, cp=2)
    moe = _Cfg(experts=4)
    moe.moe_intermediate_size = 6
    check_layout(moe, tp=2, etp=2)
    with pytest.raises(
        ValueError, match=r"ffn t4 does not divide the hidden size 6.*\[1, 2, 3, 6\]"
    ):
        check_layout(moe, etp=4)
    with pytest.raises(
        ValueError, match=r"p3 needs at least one decoder layer.*allowed p: \[1, 2\]"
    ):
        check_layout(_Cfg(), pp=3)


def test_pipeline_stage_plan_acts_on_the_pp_fields():
    from areal.models.archon.pipeline import plan_stages

    # defaults: embedding and head count as one layer each
    assert [len(r) for r in plan_stages(4, 2, "1F1B")] == [2, 2]
    assert [len(r) for r in plan_stages(6, 2, "Interleaved1F1B")] == [1, 2, 2, 1]
    assert [len(r) for r in plan_stages(4, 2, "GPipe", first_less=0, last_less=2)] == [3, 1]
    # 4 layers + 1 + 1 in stages of 3: two stages; of 1: six virtual stages
    assert [len(r) for r in plan_stages(4, 2, "1F1B", layers_per_stage=3)] == [2, 2]
    assert len(plan_stages(4, 2, "Interleaved1F1B", layers_per_stage=1)) == 6
    with pytest.raises(ValueError, match=r"pp_layers_per_stage=4: must divide"):
        plan_stages(4, 2, "1F1B", layers_per_stage=4)
    with pytest.raises(ValueError, match=r"pp_layers_per_stage=1 gives 6 stages.*exactly 2"):
        plan_stages(4, 2, "1F1B", layers_per_stage=1)
    with pytest.raises(ValueError, match=r"'ZBVZeroBubble': not supported"):
        plan_stages(4, 2, "ZBVZeroBubble")
    with pytest.raises(ValueError, match=r"cannot be split into 4 stages"):
        plan_stages(2, 4, "1F1B", first_less=0, last_less=0)
    with pytest.raises(ValueError, match="pp_first_stage_less_layers=-1: must be >= 0"):
        from areal.api.cli_args import ArchonEngineConfig

        ArchonEngineConfig(pp_first_stage_less_layers=-1)


def test_parallel_dims_world_size_mismatch_refused():
    from areal.models.archon import ArchonParallelDims

    dims = ArchonParallelDims(dp_shard=-1, tp=2, cp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.fsdp_enabled and dims.tp_enabled
    with pytest.raises(ValueError, match=r"= 4 != world_size=8"):
        ArchonParallelDims(dp_shard=2, tp=2, world_size=8)
    with pytest.raises(ValueError, match="not divisible by cp\\*tp\\*pp=4"):
        ArchonParallelDims(dp_shard=-1, tp=4, world_size=6)
    with pytest.raises(ValueError, match="dp_replicate=2"):
        ArchonParallelDims(dp_replicate=2, world_size=2)
    with pytest.raises(ValueError, match="etp=3"):
        ArchonParallelDims(tp=2, etp=3, world_size=2)


def test_engine_layout_world_size_mismatch_refused():
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.archon import archon_layout

    assert archon_layout(TrainEngineConfig(backend="archon:d2t2"), 4).tp_size == 2
    with pytest.raises(ValueError, match=r"needs d\*t\*c\*p = 4 processes.*world_size=2"):
        archon_layout(TrainEngineConfig(backend="archon:d2t2"), 2)
    with pytest.raises(ValueError, match="needs an 'archon:...' backend"):
        archon_layout(TrainEngineConfig(backend="fsdp:d2"), 2)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"offload_params": True}, "archon.offload_params=True: parameter offload"),
        ({"attn_type": "tree"}, "archon.attn_type='tree'"),
        ({"pp_schedule": "ZBVZeroBubble"}, "archon.pp_schedule='ZBVZeroBubble': ZeroBubble"),
        ({"pp_schedule": "InterleavedZeroBubble"}, "allowed: 'GPipe', '1F1B', 'Interleaved1F1B'"),
        ({"ac_debug": True}, "archon.ac_debug=True"),
    ],
)
def test_archon_options_refused_by_name(kwargs, fragment):
    from areal.api.cli_args import ArchonEngineConfig, TrainEngineConfig

    archon = ArchonEngineConfig(**kwargs)
    TrainEngineConfig(backend="fsdp:d1", archon=archon)  # not the archon engine: inert
    with pytest.raises(ValueError) as info:
        TrainEngineConfig(backend="archon:d1", archon=archon)
    assert fragment in str(info.value)


def test_archon_activation_checkpointing_modes():
    from areal.api.cli_args import ArchonEngineConfig, TrainEngineConfig

    for ok in (
        ArchonEngineConfig(ac_mode="full"),
        ArchonEngineConfig(ac_mode="selective", selective_ac_option="2"),
        ArchonEngineConfig(ac_mode="none"),
    ):
        TrainEngineConfig(backend="archon:d1", gradient_checkpointing=True, archon=ok)
    # the default (op-level selective) only matters with gradient checkpointing on
    assert TrainEngineConfig(backend="archon:d1").archon.ac_mode == "selective"
    with pytest.raises(ValueError, match="ac_mode='memory_budget' needs torch.compile"):
        TrainEngineConfig(
            backend="archon:d1",
            gradient_checkpointing=True,
            archon=ArchonEngineConfig(ac_mode="memory_budget"),
        )
    # a recomputed block would route by its own top-k, not the replayed experts
    with pytest.raises(ValueError, match="router_replay=True with gradient_checkpointing"):
        TrainEngineConfig(
            backend="archon:d1",
            gradient_checkpointing=True,
            archon=ArchonEngineConfig(ac_mode="full", router_replay=True),
        )
    TrainEngineConfig(backend="archon:d1", archon=ArchonEngineConfig(router_replay=True))


def test_experiment_allocation_archon_checks_every_model():
    from areal.api.cli_args import ArchonEngineConfig, SFTConfig, TrainEngineConfig

    SFTConfig(experiment_name="e", trial_name="t", allocation_mode="archon:d1")
    with pytest.raises(
        ValueError, match=r"SFTConfig.actor with an archon backend: archon.offload_params"
    ):
        SFTConfig(
            experiment_name="e",
            trial_name="t",
            allocation_mode="archon:d2",
            actor=TrainEngineConfig(archon=ArchonEngineConfig(offload_params=True)),
        )


def test_archon_compile_op_checkpointing_and_fp8_run_another_way_with_a_warning(caplog):
    """AReaL 2.0's archon YAMLs (tau2, FP8 SFT) set torch.compile, op-level selective
    checkpointing and FP8: the engine here runs eagerly, recomputes every block and
    trains in its own dtype, each named in a warning."""
    import logging

    from areal.api.cli_args import ArchonEngineConfig, ArchonFP8Config, TrainEngineConfig
    from areal.api.config_common import WARNED

    WARNED.clear()
    caplog.set_level(logging.WARNING)
    logging.getLogger("CLIArgs").addHandler(caplog.handler)
    try:
        cfg = TrainEngineConfig(
            backend="archon:d1",
            gradient_checkpointing=True,
            archon=ArchonEngineConfig(
                enable_compile=True, fp8_config=ArchonFP8Config(mode="blockwise")
            ),
        )
    finally:
        logging.getLogger("CLIArgs").removeHandler(caplog.handler)
    a = cfg.archon
    assert (a.enable_compile, a.ac_mode, a.fp8_config.mode) == (False, "full", "disabled")
    assert "archon.enable_compile=True: runs eagerly" in caplog.text
    assert "selective_ac_option='op': recomputes every block" in caplog.text
    assert "fp8_config.mode='blockwise': trains in the engine's dtype" in caplog.text
    # not the archon engine: the fields stay as given (inert)
    fsdp = TrainEngineConfig(backend="fsdp:d1", archon=ArchonEngineConfig(enable_compile=True))
    assert fsdp.archon.enable_compile
    # an every-N-th-block option is archon's own selective checkpointing: kept
    kept = TrainEngineConfig(
        backend="archon:d1",
        gradient_checkpointing=True,
        archon=ArchonEngineConfig(ac_mode="selective", selective_ac_option="2"),
    )
    assert kept.archon.ac_mode == "selective"


def test_select_engine_picks_archon_class_fills_backend_and_checks_heads(tmp_path):
    from conftest import build_tiny_qwen2

    from areal.api.cli_args import TrainEngineConfig
    from areal.trainer.engine_select import engine_class_for, select_engine

    path = build_tiny_qwen2(str(tmp_path / "m"))  # 4 heads, 2 KV heads
    fsdp = "areal.trainer.ppo.actor.FSDPPPOActor"
    cfg = TrainEngineConfig(path=path)
    assert select_engine(fsdp, cfg, AllocationMode.from_str("local:d1+fsdp:d2")) == fsdp
    cfg = TrainEngineConfig(path=path)
    got = select_engine(fsdp, cfg, AllocationMode.from_str("local:d1+archon:d1t2"))
    assert got == "areal.trainer.archon_hosts.ArchonPPOActor" and cfg.backend == "archon:d1t2"
    with pytest.raises(ValueError, match=r"t4 does not divide the 2 key/value heads"):
        select_engine(fsdp, TrainEngineConfig(path=path), AllocationMode.from_str("archon:d1t4"))
    with pytest.raises(ValueError, match="no engine here"):
        engine_class_for(fsdp, "megatron")
    from areal.utils.dynamic_import import import_from_string

    assert import_from_string(got).__name__ == "ArchonPPOActor"
