"""AReaL's example agents on the OpenAI SDK and ``openai-agents`` (``areal.workflow.openai``).

- ``math_agent.py``: :class:`MathAgent`, :class:`MultiTurnMathAgent`, :class:`MathToolAgent`
  (configs name them as ``workflow: areal.workflow.openai.math_agent.MathAgent``).
- ``math_tools.py``: the calculator tools and the math reward the agent modules share.

Names resolve lazily, so that ``math_tools`` (which the Anthropic and LangChain agents
import) does not pull in the ``openai-agents`` SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MathAgent": "areal.workflow.openai.math_agent",
    "MathToolAgent": "areal.workflow.openai.math_agent",
    "MultiTurnMathAgent": "areal.workflow.openai.math_agent",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
