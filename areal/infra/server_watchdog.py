"""Moved: the server watchdog lives in ``areal.infra.weights.server_watchdog``; this path
re-exports its public names."""

from areal.infra.weights.server_watchdog import ServerWatchdog

__all__ = ["ServerWatchdog"]
