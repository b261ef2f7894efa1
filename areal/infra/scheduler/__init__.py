"""Schedulers that start worker processes (``local``; ``ray``/``slurm`` come later)."""

from areal.infra.scheduler.local import LocalScheduler

__all__ = ["LocalScheduler"]
