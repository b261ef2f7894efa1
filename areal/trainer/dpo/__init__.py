"""Direct Preference Optimization: loss, engine and controller (see ``dpo_engine``).

Hosted like every algorithm of ``areal/trainer`` (see :mod:`areal.trainer.ppo`): the
engine-agnostic ``DPOEngine``, the ``DPOEngineHost`` mixin, ``FSDPDPOEngine`` for FSDP.
"""

from areal.trainer.dpo.dpo_engine import (
    DPOController,
    DPOEngine,
    DPOEngineHost,
    FSDPDPOEngine,
    compute_dpo_loss,
)

__all__ = ["DPOController", "DPOEngine", "DPOEngineHost", "FSDPDPOEngine", "compute_dpo_loss"]
