"""areal: fully asynchronous reinforcement learning for language models.

``from areal import PPOTrainer, SFTTrainer`` works; the trainers are imported lazily so
that ``import areal`` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PPOTrainer": "areal.trainer.rl_trainer",
    "SFTTrainer": "areal.trainer.sft_trainer",
}

__all__ = ["PPOTrainer", "SFTTrainer", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'areal' has no attribute {name!r}")
