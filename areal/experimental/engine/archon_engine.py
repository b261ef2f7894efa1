"""AReaL's import path of the archon engine; the code lives in ``areal.engine.archon``.

AReaL also defines the algorithm-hosting classes here (``ArchonPPOActor``, ...). In this
project they are ``areal.trainer.archon_hosts`` (``areal.experimental`` may not import
the trainers, see tests/test_import_rules.py); the trainers pick them by backend.
"""

from areal.engine.archon.engine import ArchonEngine

__all__ = ["ArchonEngine"]
