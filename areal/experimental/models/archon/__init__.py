"""AReaL's import path of the archon model families and their registry. The code lives in
``areal.models.archon``."""

from areal.models.archon import (
    ArchonParallelDims,
    BaseStateDictAdapter,
    ModelSpec,
    get_model_spec,
    get_supported_model_types,
    is_supported_model,
    register_model_spec,
)

__all__ = [
    "ArchonParallelDims",
    "BaseStateDictAdapter",
    "ModelSpec",
    "get_model_spec",
    "get_supported_model_types",
    "is_supported_model",
    "register_model_spec",
]
