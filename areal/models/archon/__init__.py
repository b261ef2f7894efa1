"""Archon model families (torchtitan's shape: args, model, state-dict adapter,
parallelize function per family) and their registry.

Built-in families: ``qwen2``, ``qwen3``, ``qwen3_moe``. Add one with ``register_model_spec`` (see
docs/engines.md). ``ArchonParallelDims`` holds the layout and builds the DeviceMesh.
"""

from areal.models.archon.base import BaseModelArgs, BaseStateDictAdapter, DenseTransformer
from areal.models.archon.model_spec import (
    ModelSpec,
    get_model_spec,
    get_supported_model_types,
    is_supported_model,
    register_model_spec,
)
from areal.models.archon.parallel_dims import ArchonParallelDims
from areal.models.archon.qwen2 import spec as qwen2_spec
from areal.models.archon.qwen3 import spec as qwen3_spec
from areal.models.archon.qwen3_moe import spec as qwen3_moe_spec
from areal.models.layout_check import check_layout

__all__ = [
    "ArchonParallelDims",
    "BaseModelArgs",
    "BaseStateDictAdapter",
    "DenseTransformer",
    "ModelSpec",
    "check_layout",
    "get_model_spec",
    "get_supported_model_types",
    "is_supported_model",
    "qwen2_spec",
    "qwen3_moe_spec",
    "qwen3_spec",
    "register_model_spec",
]
