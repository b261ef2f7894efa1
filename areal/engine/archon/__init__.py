"""The archon training engine (``ArchonEngine``) and its gradient-norm helper."""

from areal.engine.archon.engine import ArchonEngine, archon_layout

__all__ = ["ArchonEngine", "archon_layout"]
