"""What the launchers (``local``, ``ray``, ``slurm``) share: reading the controller script's
configuration from its arguments, pinning the scheduler type, and running the config's
``post_exit_hook`` once the run has ended."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from areal.utils import logging

logger = logging.getLogger("Launcher")

POST_EXIT_HOOK_TIMEOUT_S = 600.0


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


def run_names(script_args: list[str]) -> tuple[str, str, str]:
    """``(cluster.fileroot, experiment_name, trial_name)`` of the script's config (AReaL's
    defaults for missing keys; the file root made absolute)."""
    from omegaconf import OmegaConf

    cfg = script_config(script_args)
    fileroot = OmegaConf.select(cfg, "cluster.fileroot", default=None) or "/tmp/areal/"
    exp = OmegaConf.select(cfg, "experiment_name", default=None) or "default"
    trial = OmegaConf.select(cfg, "trial_name", default=None) or "trial0"
    return os.path.abspath(str(fileroot)), str(exp), str(trial)


def run_log_dir(script_args: list[str]) -> str:
    """``{cluster.fileroot}/logs/{experiment_name}/{trial_name}``: the run's log directory,
    as ``StatsLogger`` names it."""
    fileroot, exp, trial = run_names(script_args)
    return os.path.join(fileroot, "logs", exp, trial)


def run_post_exit_hook(
    script_args: list[str], timeout_s: float = POST_EXIT_HOOK_TIMEOUT_S
) -> int | None:
    """Run the config's ``post_exit_hook`` (a shell command) after the run has ended, as
    AReaL's launchers do: ``LOG_DIR`` = the run's log directory in its environment, at most
    ``timeout_s`` seconds. Its output is logged; a failure (non-zero exit, timeout, a hook
    that cannot start) is logged as a warning and never changes the run's exit code.

    Returns the hook's exit code, ``None`` when there is no hook or it did not finish."""
    from omegaconf import OmegaConf

    try:
        hook = OmegaConf.select(script_config(script_args), "post_exit_hook", default="")
    except Exception as e:  # an unreadable config already failed the run itself
        logger.warning(f"post_exit_hook: cannot read the config ({type(e).__name__}: {e})")
        return None
    hook = str(hook or "").strip()
    if not hook:
        return None
    env = dict(os.environ, LOG_DIR=run_log_dir(script_args))
    logger.info(f"Running post_exit_hook (LOG_DIR={env['LOG_DIR']}): {hook}")
    try:
        out = subprocess.run(
            hook, shell=True, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        logger.warning(f"post_exit_hook did not finish within {timeout_s:.0f} s; left: {hook}")
        return None
    except OSError as e:
        logger.warning(f"post_exit_hook could not start ({e}): {hook}")
        return None
    if out.stdout.strip():
        logger.info(f"post_exit_hook stdout: {out.stdout.strip()}")
    if out.stderr.strip():
        logger.warning(f"post_exit_hook stderr: {out.stderr.strip()}")
    if out.returncode != 0:
        logger.warning(f"post_exit_hook exited with code {out.returncode}: {hook}")
    return out.returncode


if __name__ == "__main__":  # the Slurm job's last line: python -m areal.infra.launcher.common ARGS
    run_post_exit_hook(sys.argv[1:])
