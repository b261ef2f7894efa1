"""AReaL's ``openai-agents`` multi-agent example (``areal.workflow.openai_agent``).

- ``math_agent.py``: :func:`build_math_agent`, the coordinator ``Agent`` with handoffs to
  four specialists (AReaL's ``agent_builder_path`` names it).
"""

from areal.workflow.openai_agent.math_agent import build_math_agent

__all__ = ["build_math_agent"]
