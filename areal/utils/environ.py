"""Environment switches (AReaL's ``areal.utils.environ``)."""

from __future__ import annotations

import os

__all__ = ["get_bool_env_var", "is_in_ci", "is_single_controller"]

_TRUE = ("1", "true", "yes", "on")


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """True when the variable (or ``default``) is 1/true/yes/on (any case)."""
    return os.environ.get(name, default).strip().lower() in _TRUE


def is_in_ci() -> bool:
    return get_bool_env_var("CI")


def is_single_controller() -> bool:
    """Always True here: the user's script is the one controller of the run (AReaL's
    single-controller mode); SPMD launches of the training script do not exist."""
    return True
