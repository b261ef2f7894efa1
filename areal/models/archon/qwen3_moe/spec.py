"""The qwen3_moe family's ``ModelSpec``, registered for HF ``model_type`` 'qwen3_moe'."""

from __future__ import annotations

from areal.models.archon.model_spec import ModelSpec, register_model_spec
from areal.models.archon.qwen3_moe.args import Qwen3MoeModelArgs
from areal.models.archon.qwen3_moe.model import Qwen3MoeModel
from areal.models.archon.qwen3_moe.parallelize import parallelize_qwen3_moe
from areal.models.archon.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

__all__ = ["QWEN3_MOE_SPEC"]

QWEN3_MOE_SPEC = register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        model_class=Qwen3MoeModel,
        model_args_class=Qwen3MoeModelArgs,
        state_dict_adapter_class=Qwen3MoeStateDictAdapter,
        parallelize_fn=parallelize_qwen3_moe,
        supported_model_types=frozenset({"qwen3_moe"}),
    )
)
