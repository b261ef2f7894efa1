"""The registry of archon model families: ``ModelSpec`` (model class, args class,
state-dict adapter, parallelize function, HF ``model_type`` values) and the functions
that register and look families up.

A user adds a family by building a ``ModelSpec`` and calling ``register_model_spec``
(see docs/engines.md, "Adding a model family"); the built-in families register when
``areal.models.archon`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

__all__ = [
    "ModelSpec",
    "get_model_spec",
    "get_supported_model_types",
    "is_supported_model",
    "register_model_spec",
]


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    ``parallelize_fn(model, parallel_dims, *, param_dtype, reduce_dtype,
    reshard_after_forward, ac_every) -> model`` applies tensor / context parallelism,
    activation checkpointing and FSDP in that order (torchtitan's order)."""

    name: str
    model_class: type[nn.Module]
    model_args_class: type
    state_dict_adapter_class: type
    parallelize_fn: Callable[..., nn.Module]
    supported_model_types: frozenset[str]


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Register ``spec`` under each of its HF ``model_type`` values (a taken one is refused)."""
    for t in spec.supported_model_types:
        held = _REGISTRY.get(t)
        if held is not None and held is not spec:
            raise ValueError(
                f"model_type {t!r} is already registered by archon family {held.name!r}"
            )
    for t in spec.supported_model_types:
        _REGISTRY[t] = spec
    return spec


def get_model_spec(model_type: str) -> ModelSpec:
    spec = _REGISTRY.get(model_type)
    if spec is None:
        raise ValueError(
            f"HF model_type {model_type!r} has no archon model family; supported: "
            f"{sorted(_REGISTRY)} (register one with areal.models.archon.register_model_spec)"
        )
    return spec


def is_supported_model(model_type: str) -> bool:
    return model_type in _REGISTRY


def get_supported_model_types() -> frozenset[str]:
    return frozenset(_REGISTRY)
