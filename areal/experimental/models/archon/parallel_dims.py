"""AReaL's import path of ``ArchonParallelDims``; the code lives in
``areal.models.archon.parallel_dims``."""

from areal.models.archon.parallel_dims import ArchonParallelDims

__all__ = ["ArchonParallelDims"]
