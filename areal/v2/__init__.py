"""AReaL 2.0's ``areal.v2`` import paths that its client programs use.

Only what 2.0's agent-service clients import lives here (``areal.v2.agent_service``);
the rest of this project keeps its own layout (docs/areal_compat.md).
"""
