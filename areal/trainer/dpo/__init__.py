"""Direct Preference Optimization: loss, engine and controller (see ``dpo_engine``;
hosted as :mod:`areal.trainer.ppo` describes: ``DPOEngine``, ``DPOEngineHost``,
``FSDPDPOEngine``)."""

from areal.trainer.dpo.dpo_engine import DPOController, DPOEngine, compute_dpo_loss

__all__ = ["DPOController", "DPOEngine", "compute_dpo_loss"]
