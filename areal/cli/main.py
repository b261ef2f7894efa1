"""``areal``: the console script (``[project.scripts]``); ``python -m areal.cli`` too.

Verbs (AReaL 2.0's): ``train`` (``areal/cli/train.py``), ``inf`` (``inf.py``),
``agent run`` (``agent.py``). User errors print ``areal: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from areal.cli import agent, inf, train
from areal.cli.train import CliError

#: ``areal train run`` / ``areal inf run`` (2.0) are ``areal train`` / ``areal inf``.
_RUN_ALIASES = ("train", "inf")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areal",
        description="areal command line: train, serve, agents (AReaL 2.0's verbs)",
    )
    sub = p.add_subparsers(dest="verb", metavar="{train,inf,agent}")
    sub.required = True
    train.add_parser(sub)
    inf.add_parser(sub)
    agent.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] in _RUN_ALIASES and argv[1] == "run":
        del argv[1]
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage message on a bad verb or flag
    # SIGTERM unwinds like Ctrl-C, so the servers a verb started are stopped on the way out
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        parser.exit(2, f"areal: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 0


def _raise_exit(signum, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def cli() -> None:
    """The console-script entry point."""
    sys.exit(main())
