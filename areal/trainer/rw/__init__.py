"""Reward-model training: Bradley-Terry loss, engine and controller (see ``rw_engine``)."""

from areal.trainer.rw.rw_engine import RWController, RWEngine, compute_rw_loss

__all__ = ["RWController", "RWEngine", "compute_rw_loss"]
