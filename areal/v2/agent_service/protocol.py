"""Names shared by the agent service's processes and its agents.

``QueueMode`` is the field AReaL 2.0's turn requests carry (how a message that arrives
while the session's previous turn still runs is treated). Here turns of one session are
always run one after the other in arrival order, whichever mode is named; the value is
passed through to the agent unchanged.
"""

from __future__ import annotations

import enum
import uuid

# Header that pins a request to a session when the body has no ``user`` (2.0's name).
SESSION_KEY_HEADER = "X-AReaL-Session-Key"
# Environment variable through which the controller hands the admin key to its processes
# (never on a command line, where ``ps`` shows it).
ADMIN_KEY_ENV = "AREAL_AGENT_ADMIN_KEY"


class QueueMode(enum.StrEnum):
    COLLECT = "collect"
    FOLLOWUP = "followup"

    @classmethod
    def parse(cls, value: object) -> QueueMode:
        """The mode named by ``value``; ``COLLECT`` for anything unknown."""
        try:
            return cls(value)
        except ValueError:
            return cls.COLLECT


def generate_run_id() -> str:
    """A fresh id for one turn (``run-`` + 12 hex digits)."""
    return f"run-{uuid.uuid4().hex[:12]}"
