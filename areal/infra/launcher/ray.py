"""Run a controller script against a Ray cluster (``scheduler.type=ray``).

    python -m areal.infra.launcher.ray [--address ADDR] SCRIPT --config FILE.yaml [key=value ...]

The script (e.g. ``examples/math/gsm8k_rl.py``) runs here as the Ray driver, with
``scheduler.type=ray`` appended to its overrides; its ``RayScheduler`` places the
inference servers and training workers as actors. ``--address`` (or ``$RAY_ADDRESS``)
selects the cluster: ``auto`` = the cluster started on this node with
``ray start --head``, ``HOST:6379`` = a remote head; neither = a local Ray started for
the run and shut down at its end. SIGINT/SIGTERM are forwarded to the script so the
trainer tears its actors down. Then the config's ``post_exit_hook`` runs (``LOG_DIR``
set). The exit code is the script's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from areal.infra.launcher.common import run_post_exit_hook, script_command
from areal.utils import logging

logger = logging.getLogger("RayLauncher")


def build_command(script: str, script_args: list[str]) -> list[str]:
    """``python SCRIPT ARGS... scheduler.type=ray`` (an explicit scheduler.type is replaced)."""
    return script_command(script, script_args, "ray")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.infra.launcher.ray",
        description="Run an areal controller script with scheduler.type=ray.",
    )
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else local)"
    )
    parser.add_argument("script", help="controller script, e.g. examples/math/gsm8k_rl.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="--config FILE and overrides")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    if args.address:
        env["RAY_ADDRESS"] = args.address
    cmd = build_command(args.script, args.script_args)
    logger.info(f"Ray address {env.get('RAY_ADDRESS', '<local>')}; running {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env=env)

    def _forward(signum, _frame):
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _forward)
    try:
        return proc.wait()
    finally:
        run_post_exit_hook(args.script_args)


if __name__ == "__main__":
    sys.exit(main())
