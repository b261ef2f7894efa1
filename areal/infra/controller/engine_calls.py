"""The engine methods ``TrainController`` passes through unchanged, one explicit method each.

The algorithm hosts (``areal.trainer``'s FSDP and Archon classes) have methods the
controller calls on every rank as they are, with no splitting or merging of its own.
:func:`add_engine_calls` gives the controller one method per name in
:data:`ENGINE_CALLS`, so a misspelt name is an ``AttributeError`` on the controller, not a
remote call; any other engine method goes through ``custom_function_call(name, ...)``.
``tests/test_train_controller.py`` checks that every public method of the hosts is either
written out on the controller or listed here.
"""

from __future__ import annotations

from typing import Any

ENGINE_CALLS = (
    "compute_ref_logp",
    "compute_values",
    "create_process_group",
    "current_data_parallel_head",
    "enable_weight_fingerprints",
    "evaluate_dpo",
    "evaluate_lm",
    "evaluate_rw",
    "get_param_specs",
    "has_pending_save",
    "init_weights_update_group",
    "is_data_parallel_head",
    "offload",
    "onload",
    "optimizer_step",
    "optimizer_zero_grad",
    "train_dpo",
    "train_lm",
    "train_rw",
    "wait_async_save",
    "weights_fingerprint",
)


def _engine_call(name: str):
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.custom_function_call(name, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``engine.{name}`` on every rank (``custom_function_call``)."
    return call


def add_engine_calls(cls: type) -> type:
    """Add one method per :data:`ENGINE_CALLS` name to ``cls`` (none may exist yet)."""
    for name in ENGINE_CALLS:
        if name in vars(cls):
            raise RuntimeError(f"{cls.__name__}.{name} is written out; drop it from ENGINE_CALLS")
        setattr(cls, name, _engine_call(name))
    return cls
