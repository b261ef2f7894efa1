"""AReaL's ``areal.experimental.models`` path: the archon model families (``archon``)."""
