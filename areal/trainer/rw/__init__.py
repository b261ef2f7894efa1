"""Reward-model training: Bradley-Terry loss, engine and controller (see ``rw_engine``).

Hosted like every algorithm of ``areal/trainer`` (see :mod:`areal.trainer.ppo`): the
engine-agnostic ``RWEngine``, the ``RWEngineHost`` mixin, ``FSDPRWEngine`` for FSDP.
"""

from areal.trainer.rw.rw_engine import (
    FSDPRWEngine,
    RWController,
    RWEngine,
    RWEngineHost,
    compute_rw_loss,
)

__all__ = ["FSDPRWEngine", "RWController", "RWEngine", "RWEngineHost", "compute_rw_loss"]
