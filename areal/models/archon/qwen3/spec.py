"""The qwen3 family's ``ModelSpec``, registered for HF ``model_type`` 'qwen3'."""

from __future__ import annotations

from areal.models.archon.model_spec import ModelSpec, register_model_spec
from areal.models.archon.qwen3.args import Qwen3ModelArgs
from areal.models.archon.qwen3.model import Qwen3Model
from areal.models.archon.qwen3.parallelize import parallelize_qwen3
from areal.models.archon.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = ["QWEN3_SPEC"]

QWEN3_SPEC = register_model_spec(
    ModelSpec(
        name="qwen3",
        model_class=Qwen3Model,
        model_args_class=Qwen3ModelArgs,
        state_dict_adapter_class=Qwen3StateDictAdapter,
        parallelize_fn=parallelize_qwen3,
        supported_model_types=frozenset({"qwen3"}),
    )
)
