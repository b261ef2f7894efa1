"""Global seeding and reproducible per-request sampling seeds.

``set_random_seed(seed)`` seeds Python, NumPy and torch and remembers ``seed``;
``request_seed(*parts)`` then derives a stable 63-bit seed for one generation request
from that base seed and the request's identity (prompt tokens, sample index, policy
version). Servers that honour per-request seeds (the built-in one, vLLM, SGLang) then
sample the same tokens for the same request in every run, which makes a resumed
synchronous run reproduce the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

_BASE_SEED: int | None = None


def set_random_seed(seed: int) -> None:
    global _BASE_SEED
    _BASE_SEED = int(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_base_seed() -> int | None:
    return _BASE_SEED


def request_seed(*parts: Any) -> int | None:
    """Stable seed from the base seed and ``parts``; ``None`` when no base seed was set."""
    if _BASE_SEED is None:
        return None
    h = hashlib.sha256(repr((_BASE_SEED, *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1
