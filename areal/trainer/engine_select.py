"""Which worker class a training role runs: the FSDP class, or its archon twin when the
role's backend (or the allocation's training component) is ``archon``.

``select_engine`` runs in the controller before any worker starts: it also writes the
allocation's archon layout into the role's empty ``backend`` (the engine reads it there)
and checks that layout against the model's HF config (``check_layout``: heads divisible
by tp, no ep on a dense model, ...). Class paths are strings: the controller does not
import the engines.
"""

from __future__ import annotations

import os
from typing import Any

from areal.api.alloc_mode import ParallelStrategy
from areal.models.layout_check import check_layout

__all__ = ["engine_class_for", "select_engine"]

_HOSTS = "areal.trainer.archon_hosts"
_ARCHON_CLASSES = {
    "FSDPPPOActor": f"{_HOSTS}.ArchonPPOActor",
    "FSDPPPOCritic": f"{_HOSTS}.ArchonPPOCritic",
    "FSDPLMEngine": f"{_HOSTS}.ArchonLMEngine",
    "FSDPRWEngine": f"{_HOSTS}.ArchonRWEngine",
    "FSDPDPOEngine": f"{_HOSTS}.ArchonDPOEngine",
}


def engine_class_for(fsdp_path: str, backend: str | None) -> str:
    """``fsdp_path`` for 'fsdp' (or no backend); the archon class's path for 'archon'."""
    if backend in (None, "fsdp"):
        return fsdp_path
    if backend == "archon":
        name = fsdp_path.rsplit(".", 1)[-1]
        if name not in _ARCHON_CLASSES:
            raise ValueError(f"{fsdp_path!r} has no archon twin; known: {sorted(_ARCHON_CLASSES)}")
        return _ARCHON_CLASSES[name]
    raise ValueError(f"training backend {backend!r} has no engine here; allowed: fsdp, archon")


def select_engine(fsdp_path: str, engine_config: Any, alloc_mode: Any) -> str:
    """The worker class path of a role (module docstring); the role's own ``backend``
    wins over the allocation's training component."""
    if engine_config.backend:
        alloc = ParallelStrategy.parse_backend(engine_config.backend)
        backend, parallel = alloc.backend, alloc.parallel
    else:
        backend, parallel = alloc_mode.train_backend, alloc_mode.train
    path = engine_class_for(fsdp_path, backend)
    if backend == "archon":
        if not engine_config.backend:
            engine_config.backend = f"archon:{parallel}"
        if os.path.exists(os.path.join(engine_config.path or "", "config.json")):
            from transformers import AutoConfig

            check_layout(
                AutoConfig.from_pretrained(engine_config.path),
                tp=parallel.tp_size,
                cp=parallel.cp_size,
                ep=parallel.ep_size,
                pp=parallel.pp_size,
                etp=parallel.etp_size,
            )
    return path
