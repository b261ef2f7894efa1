"""Global seeding and reproducible per-request sampling seeds.

``set_random_seed(seed, key=None)`` seeds Python, NumPy and torch and remembers ``seed``
(AReaL's signature: with a ``key`` such as ``f"trainer{rank}"`` the generators get
``seed + hash(key)``, so that processes of one run draw different numbers);
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
_SEED: int | None = None
_SHUFFLE_COUNT = 0


def _seed_from_key(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


def set_random_seed(base_seed: int, key: str | None = None) -> None:
    """Seed ``random``, NumPy and torch with ``base_seed`` (+ a stable hash of ``key``).

    ``base_seed`` is what :func:`request_seed` derives request seeds from, whatever the key.
    """
    global _BASE_SEED, _SEED, _SHUFFLE_COUNT
    seed = int(base_seed) + (_seed_from_key(str(key)) if key is not None else 0)
    _BASE_SEED, _SEED, _SHUFFLE_COUNT = int(base_seed), seed, 0
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_base_seed() -> int | None:
    return _BASE_SEED


def get_seed() -> int:
    """The seed the generators got (base seed + key hash); raises before ``set_random_seed``."""
    if _SEED is None:
        raise ValueError("Random seed is not set: call set_random_seed first")
    return _SEED


def get_shuffle_seed() -> int:
    """A new deterministic seed on every call (same sequence in every run with the same base)."""
    global _SHUFFLE_COUNT
    seed = _seed_from_key(f"areal-shuffle-{_BASE_SEED}-{_SHUFFLE_COUNT}")
    _SHUFFLE_COUNT += 1
    return seed


def request_seed(*parts: Any) -> int | None:
    """Stable seed from the base seed and ``parts``; ``None`` when no base seed was set."""
    if _BASE_SEED is None:
        return None
    h = hashlib.sha256(repr((_BASE_SEED, *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1
