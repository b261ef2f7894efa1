"""Reward-model training: Bradley-Terry loss, engine and controller (see ``rw_engine``;
hosted as :mod:`areal.trainer.ppo` describes: ``RWEngine``, ``RWEngineHost``,
``FSDPRWEngine``)."""

from areal.trainer.rw.rw_engine import RWController, RWEngine, compute_rw_loss

__all__ = ["RWController", "RWEngine", "compute_rw_loss"]
