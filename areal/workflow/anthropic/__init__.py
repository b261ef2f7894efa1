"""AReaL's example agents on the Anthropic Messages API (``areal.workflow.anthropic``).

- ``math_agent.py``: :class:`MathAgent`, one ``messages.create`` call.
- ``claude_math_agent.py``: :class:`MathToolAgent`, a calculator tool loop
  (``tool_use`` / ``tool_result`` blocks).

Both talk to the proxy's ``/v1/messages`` with ``anthropic.AsyncAnthropic``.
"""

from areal.workflow.anthropic.claude_math_agent import MathToolAgent
from areal.workflow.anthropic.math_agent import MathAgent

__all__ = ["MathAgent", "MathToolAgent"]
