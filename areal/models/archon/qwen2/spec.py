"""The qwen2 family's ``ModelSpec``, registered for HF ``model_type`` 'qwen2'."""

from __future__ import annotations

from areal.models.archon.model_spec import ModelSpec, register_model_spec
from areal.models.archon.qwen2.args import Qwen2ModelArgs
from areal.models.archon.qwen2.model import Qwen2Model
from areal.models.archon.qwen2.parallelize import parallelize_qwen2
from areal.models.archon.qwen2.state_dict_adapter import Qwen2StateDictAdapter

__all__ = ["QWEN2_SPEC"]

QWEN2_SPEC = register_model_spec(
    ModelSpec(
        name="qwen2",
        model_class=Qwen2Model,
        model_args_class=Qwen2ModelArgs,
        state_dict_adapter_class=Qwen2StateDictAdapter,
        parallelize_fn=parallelize_qwen2,
        supported_model_types=frozenset({"qwen2"}),
    )
)
