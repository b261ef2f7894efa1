"""Helpers shared by the config modules: field metadata, validation messages, once-per-run warnings.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

from dataclasses import MISSING as _DC_MISSING
from dataclasses import asdict, field
from typing import Any, TypeVar

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from areal.utils import logging

logger = logging.getLogger("CLIArgs")


ConfigT = TypeVar("ConfigT")


NOT_ACTED = "This project accepts this section so AReaL YAMLs load, but does not act on it yet."


def cfield(
    default: Any = _DC_MISSING, help: str = "", choices: list | None = None, factory: Any = None
) -> Any:
    """A config field: ``dataclasses.field`` with help text (and optional allowed values) in
    its metadata."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key in WARNED:
        return
    WARNED.add(key)
    logger.warning(message)


def _is_missing(value: Any) -> bool:
    return isinstance(value, str) and value == MISSING


def check_choice(owner: str, name: str, value: Any, allowed: list | tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed; choose one of {list(allowed)}")


def check_range(
    owner: str,
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    optional: bool = False,
) -> None:
    """Raise ValueError naming ``owner.name`` when ``value`` is outside the given bounds."""
    if value is None:
        if optional:
            return
        raise ValueError(f"{owner}.{name}=None is not allowed; a number is required")
    bounds = []
    ok = True
    if gt is not None:
        bounds.append(f"> {gt}")
        ok &= value > gt
    if ge is not None:
        bounds.append(f">= {ge}")
        ok &= value >= ge
    if lt is not None:
        bounds.append(f"< {lt}")
        ok &= value < lt
    if le is not None:
        bounds.append(f"<= {le}")
        ok &= value <= le
    if not ok:
        extra = " (or None)" if optional else ""
        raise ValueError(
            f"{owner}.{name}={value!r} is not allowed; must be {' and '.join(bounds)}{extra}"
        )


def conf_as_dict(cfg: Any) -> dict:
    """Plain dict of a dataclass config or an OmegaConf node (interpolations resolved)."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return asdict(cfg)
