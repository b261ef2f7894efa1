"""AReaL's ``areal.experimental.engine`` path: the archon engine (``archon_engine``)."""
