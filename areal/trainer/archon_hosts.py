"""The algorithms hosted on ``ArchonEngine``: the same host mixins as the FSDP classes
(``areal.trainer.ppo``, ``rw``, ``dpo``, ``sft``), on the archon engine. AReaL's names;
``areal.experimental.engine.archon_engine`` re-exports them.
``areal.trainer.engine_select`` picks these for an archon backend.
"""

from __future__ import annotations

import copy
from typing import Any

from areal.engine.archon import ArchonEngine
from areal.trainer.dpo.dpo_engine import DPOEngineHost
from areal.trainer.ppo.actor import PPOActorHost
from areal.trainer.ppo.critic import PPOCriticHost
from areal.trainer.rw.rw_engine import RWEngineHost
from areal.trainer.sft.lm_engine import LMEngineHost

__all__ = [
    "ArchonDPOEngine",
    "ArchonLMEngine",
    "ArchonPPOActor",
    "ArchonPPOCritic",
    "ArchonRWEngine",
]


class ArchonPPOActor(PPOActorHost, ArchonEngine):
    """Archon engine hosting a ``PPOActor`` (actor, reference, teacher)."""


class ArchonPPOCritic(PPOCriticHost, ArchonEngine):
    """Archon engine (``is_critic=True``) hosting a ``PPOCritic``."""


class ArchonLMEngine(LMEngineHost, ArchonEngine):
    """Archon engine hosting an ``LMEngine`` (SFT)."""


class ArchonRWEngine(RWEngineHost, ArchonEngine):
    """Archon critic engine hosting an ``RWEngine``."""


class ArchonDPOEngine(DPOEngineHost, ArchonEngine):
    """Archon policy engine hosting a ``DPOEngine`` with an archon reference model."""

    reference_engine_class = ArchonEngine

    def initialize(self, addr: str | None = None, ft_spec: Any = None, **kwargs: Any) -> None:
        ref = kwargs.get("ref_config")
        if ref is not None and not ref.backend:  # the reference shares the policy's layout
            ref = copy.copy(ref)
            ref.backend = self.config.backend
            kwargs["ref_config"] = ref
        super().initialize(addr=addr, ft_spec=ft_spec, **kwargs)
