"""AReaL's multi-agent math solver on ``openai-agents`` (``areal.workflow.openai_agent``).

:func:`build_math_agent` is what AReaL's ``examples/openai_agents`` config names as
``agent_builder_path: areal.workflow.openai_agent.math_agent.build_math_agent``: it
returns the coordinating ``Agent``, which can hand the problem off to four specialists
(analysis, solution, refinement, verification). The example's workflow runs it with
``Runner.run(agent, question, run_config=...)`` on an OpenAI client the proxy (or
``ArealOpenAI``) serves, one recorded model call per agent turn.

Beyond AReaL's builder (which takes no arguments): ``tools`` gives the coordinator and
every specialist calculator function tools by name (:mod:`areal.workflow.openai.math_tools`),
``instructions=False`` drops the system prompts and ``handoffs=False`` the four specialists
(the tiny tool model was trained with neither handoffs nor instructions: with
``tools=["calculator"]``, ``instructions=False``, ``handoffs=False`` the agent is the one it
was trained as, set from AReaL's YAML by ``agent_builder_kwargs`` overrides).
"""

from __future__ import annotations

from collections.abc import Sequence

import agents
from agents.extensions.handoff_prompt import RECOMMENDED_PROMPT_PREFIX

from areal.workflow.openai.math_agent import CALCULATOR_TOOLS
from areal.workflow.openai.math_tools import check_tool_names

__all__ = ["build_math_agent"]

# (agent name, handoff tool name, handoff description, instructions)
SPECIALISTS = [
    (
        "Problem Analyzer",
        "analyze_problem",
        "Work out what the problem gives, what it asks and how to approach it",
        "You analyse math problems: state what is known, what is asked, which kind of "
        "problem it is and a plan to solve it. Hand off to the Solution Specialist for "
        "the solution.",
    ),
    (
        "Solution Specialist",
        "solve_problem",
        "Solve the problem step by step, showing the calculations",
        "You solve math problems step by step and show every calculation. Hand off to the "
        "Verification Agent to check the result, or to the Refinement Agent to improve it.",
    ),
    (
        "Refinement Agent",
        "refine_solution",
        "Find and fix mistakes in a previous attempt",
        "You review an earlier attempt, find its mistakes and give a corrected solution. "
        "Then hand off to the Verification Agent.",
    ),
    (
        "Verification Agent",
        "verify_solution",
        "Check the solution and give the final answer",
        "You check a solution step by step and give the final, verified answer. This is "
        "the last stage.",
    ),
]

COORDINATOR = (
    "You coordinate the solution of a math problem. Understand it, then hand it to the "
    "specialists as needed (analysis, solution, refinement, verification), and make sure "
    "the final answer is correct and complete."
)


def build_math_agent(
    tools: Sequence[str] = (), instructions: bool = True, handoffs: bool = True
) -> agents.Agent:
    """The coordinating math agent with handoffs to four specialist agents (none when
    ``handoffs`` is false)."""
    offered = [CALCULATOR_TOOLS[n] for n in check_tool_names(tools)] if tools else []

    def prompt(text: str) -> str | None:
        return f"{RECOMMENDED_PROMPT_PREFIX}\n{text}" if instructions else None

    specialists = [
        agents.handoff(
            agent=agents.Agent(name=name, instructions=prompt(text), tools=list(offered)),
            tool_name_override=tool_name,
            tool_description_override=description,
        )
        for name, tool_name, description, text in SPECIALISTS
        if handoffs
    ]
    return agents.Agent(
        name="Math Problem Solver",
        instructions=prompt(COORDINATOR),
        tools=list(offered),
        handoffs=specialists,
    )
