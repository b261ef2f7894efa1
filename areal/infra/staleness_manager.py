"""Old path of ``StalenessManager``, kept as a re-export.

The code lives in ``areal.infra.rollout.staleness_manager``.
"""

from areal.infra.rollout.staleness_manager import (
    RolloutStat,
    StalenessManager,
)

__all__ = ["RolloutStat", "StalenessManager"]
