"""Training engines and everything inference.

``from areal.engine import RemotevLLMEngine`` (AReaL's import path) works; names are
imported lazily so that ``import areal.engine`` stays light:

- ``RemoteLocalEngine`` / ``RemotevLLMEngine`` / ``RemoteSGLangEngine``: clients of the
  built-in / vLLM / SGLang servers (``as_controller(config, scheduler)`` starts servers
  through a scheduler);
- ``FSDPEngine``: the FSDP2 training engine;
- ``ArchonEngine``: the parallel (FSDP2 x tensor x context) training engine;
- ``inference_backends``: the registry backend name -> engine, adapter, server command.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "RemoteLocalEngine": "areal.engine.local_remote",
    "RemotevLLMEngine": "areal.engine.vllm_remote",
    "RemoteSGLangEngine": "areal.engine.sglang_remote",
    "FSDPEngine": "areal.engine.fsdp_engine",
    "ArchonEngine": "areal.engine.archon",
}

__all__ = [*_LAZY, "inference_backends"]


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "inference_backends":
        return importlib.import_module("areal.engine.inference_backends")
    raise AttributeError(f"module 'areal.engine' has no attribute {name!r}")
