"""What the launchers (``local``, ``ray``, ``slurm``) share: reading the controller script's
configuration from its arguments, and pinning the scheduler type."""

from __future__ import annotations

import sys
from typing import Any


def script_config(script_args: list[str]) -> Any:
    """The ``OmegaConf`` config of ``--config FILE`` (several are merged in order, also as
    ``--config=FILE``) plus ``key=value`` overrides (a leading ``+`` is dropped), as the
    script itself will see it; options (``-x``) are ignored."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create()
    overrides = []
    i = 0
    while i < len(script_args):
        a = script_args[i]
        if a == "--config" and i + 1 < len(script_args):
            cfg = OmegaConf.merge(cfg, OmegaConf.load(script_args[i + 1]))
            i += 1
        elif a.startswith("--config="):
            cfg = OmegaConf.merge(cfg, OmegaConf.load(a.split("=", 1)[1]))
        elif "=" in a and not a.startswith("-"):
            overrides.append(a.lstrip("+"))
        i += 1
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    return cfg


def script_command(script: str, script_args: list[str], scheduler_type: str) -> list[str]:
    """``python SCRIPT ARGS... scheduler.type=TYPE`` (an explicit ``scheduler.type`` in the
    arguments is replaced)."""
    args = [a for a in script_args if not a.startswith(("scheduler.type=", "+scheduler.type="))]
    return [sys.executable, script, *args, f"scheduler.type={scheduler_type}"]
