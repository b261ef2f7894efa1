"""Project logging: ``getLogger("PascalCaseName")``.

Format: ``YYYYmmdd-HH:MM:SS.mmm [Component Rank N] LEVEL message``. The rank comes
from ``RANK`` (torch.distributed launchers) when set. Colours only when stderr is a
TTY. Level from ``AREAL_LOG_LEVEL`` (default ``INFO``).
"""

from __future__ import annotations

import logging
import os
import sys

_COLORS = {
    "DEBUG": "\033[36m",
    "INFO": "\033[32m",
    "WARNING": "\033[33m",
    "ERROR": "\033[31m",
    "CRITICAL": "\033[1;31m",
}
_RESET = "\033[0m"
_ROOT = "areal"


class _ComponentFormatter(logging.Formatter):
    def __init__(self, color: bool):
        super().__init__(datefmt="%Y%m%d-%H:%M:%S")
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        component = (
            record.name.split(".", 1)[1] if record.name.startswith(_ROOT + ".") else record.name
        )
        rank = os.environ.get("RANK")
        tag = f"[{component} Rank {rank}]" if rank is not None else f"[{component}]"
        level = record.levelname
        if self.color:
            level = f"{_COLORS.get(level, '')}{level}{_RESET}"
        msg = record.getMessage()
        if record.exc_info:
            msg = msg + "\n" + self.formatException(record.exc_info)
        ts = self.formatTime(record, self.datefmt)
        return f"{ts}.{int(record.msecs):03d} {tag} {level} {msg}"


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_areal_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_ComponentFormatter(color=sys.stderr.isatty()))
        root.addHandler(handler)
        root.propagate = False
        root.setLevel(os.environ.get("AREAL_LOG_LEVEL", "INFO").upper())
        root._areal_configured = True  # type: ignore[attr-defined]
    return root


def getLogger(name: str) -> logging.Logger:  # noqa: N802 - AReaL's public name
    """Return the logger of one component, e.g. ``getLogger("FSDPEngine")``."""
    _configure_root()
    return logging.getLogger(f"{_ROOT}.{name}")


def setup_file_logging(log_dir: str, filename: str = "main.log", level: int | str = "INFO") -> str:
    """Also write every ``areal`` log record to ``{log_dir}/{filename}`` (AReaL's name).

    Idempotent per file; returns the file's path.
    """
    root = _configure_root()
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.abspath(os.path.join(log_dir, filename))
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and h.baseFilename == path:
            return path
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(_ComponentFormatter(color=False))
    handler.setLevel(level.upper() if isinstance(level, str) else level)
    root.addHandler(handler)
    return path
