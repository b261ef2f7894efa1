"""AReaL's LangChain agents (``areal.workflow.langchain``): ``ChatOpenAI`` on the proxy.

- ``math_agent.py``: :class:`MathAgent` (one call) and :class:`MathToolAgent`
  (``create_agent`` with the calculator tools).
"""

from areal.workflow.langchain.math_agent import MathAgent, MathToolAgent

__all__ = ["MathAgent", "MathToolAgent"]
