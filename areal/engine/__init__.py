"""Training engines: ``FSDPEngine`` (FSDP2, ``areal.engine.fsdp``) and ``ArchonEngine``
(FSDP2 x tensor x context x expert x pipeline, ``areal.engine.archon``), LoRA on them
(``lora``). Everything that serves or calls an inference server is in ``areal.inference``.

``from areal.engine import RemotevLLMEngine`` (AReaL's import path) still works: the
client engines are re-exported from ``areal.inference.clients``. Names are imported lazily
so that ``import areal.engine`` stays light.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "FSDPEngine": "areal.engine.fsdp",
    "ArchonEngine": "areal.engine.archon",
    # AReaL's paths of the inference clients
    "RemoteLocalEngine": "areal.inference.clients.local",
    "RemotevLLMEngine": "areal.inference.clients.vllm",
    "RemoteSGLangEngine": "areal.inference.clients.sglang",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'areal.engine' has no attribute {name!r}")
