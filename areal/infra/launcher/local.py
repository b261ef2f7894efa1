"""Run a controller script on this machine and relaunch it after a crash.

    python -m areal.infra.launcher.local SCRIPT --config FILE.yaml [key=value ...]

The script runs as a child process. When it exits with a non-zero code (a crash, an
OOM kill, a dead training worker) and ``recover.mode`` is ``on`` or ``auto``, it is
started again with the same arguments, up to ``recover.retries`` times; each rerun
resumes from the newest complete recover checkpoint. SIGINT/SIGTERM are forwarded to the
script and stop the retries. Then the config's ``post_exit_hook`` runs (once, after the
last run, with ``LOG_DIR`` set). The exit code is the last run's.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from omegaconf import OmegaConf

from areal.infra.launcher.common import run_post_exit_hook, script_config
from areal.utils import logging

logger = logging.getLogger("LocalLauncher")


def read_recover_settings(script_args: list[str]) -> tuple[str, int]:
    """``(recover.mode, recover.retries)`` from ``--config`` + overrides (defaults: disabled, 3)."""
    cfg = script_config(script_args)
    mode = OmegaConf.select(cfg, "recover.mode", default="disabled") or "disabled"
    retries = OmegaConf.select(cfg, "recover.retries", default=3)
    return str(mode), int(3 if retries is None else retries)


def run_with_retries(cmd: list[str], mode: str, retries: int, backoff_s: float = 2.0) -> int:
    allowed = retries if mode in ("on", "auto") else 0
    attempt = 0
    stop = {"flag": False}
    proc: subprocess.Popen | None = None

    def _forward(signum, _frame):
        stop["flag"] = True
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            proc = subprocess.Popen(cmd)
            rc = proc.wait()
            if rc == 0 or stop["flag"]:
                return rc
            if attempt >= allowed:
                if allowed:
                    logger.error(
                        f"Run failed with exit code {rc}; no retries left ({allowed} used)"
                    )
                return rc
            attempt += 1
            logger.warning(
                f"Run failed with exit code {rc}; relaunching ({attempt}/{allowed}) to resume from the "
                "last recover checkpoint"
            )
            time.sleep(backoff_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None, backoff_s: float = 2.0) -> int:
    """Parse ``SCRIPT [--config FILE] [overrides]`` and run it with retries.

    ``backoff_s``: pause between a crash and the relaunch.
    """
    parser = argparse.ArgumentParser(
        prog="python -m areal.infra.launcher.local",
        description="Run an areal controller script locally; relaunch after crashes (recover.retries).",
    )
    parser.add_argument("script", help="controller script, e.g. examples/math/gsm8k_rl.py")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="--config FILE and key=value overrides"
    )
    args = parser.parse_args(argv)
    mode, retries = read_recover_settings(args.script_args)
    try:
        return run_with_retries(
            [sys.executable, args.script, *args.script_args], mode, retries, backoff_s=backoff_s
        )
    finally:
        run_post_exit_hook(args.script_args)


if __name__ == "__main__":
    sys.exit(main())
