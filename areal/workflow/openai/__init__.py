"""AReaL's example agents on the OpenAI SDK and ``openai-agents`` (``areal.workflow.openai``).

- ``math_agent.py``: :class:`MathAgent`, :class:`MultiTurnMathAgent`, :class:`MathToolAgent`
  (configs name them as ``workflow: areal.workflow.openai.math_agent.MathAgent``).
- ``math_tools.py``: the calculator tools and the math reward the agent modules share.
"""

from areal.workflow.openai.math_agent import MathAgent, MathToolAgent, MultiTurnMathAgent

__all__ = ["MathAgent", "MathToolAgent", "MultiTurnMathAgent"]
