"""The sandbox as agents and rewards use it.

- :class:`PythonTool`: the function tool ``python`` (an OpenAI-style schema and an async
  call returning the text a TIR agent sees: the snippet's stdout, or
  ``"Error: <reason>"`` followed by the tail of stderr);
- :func:`run_tests_against` (async) / :func:`run_tests_against_sync` (for reward
  functions, which are synchronous): run a test program against model-written code in
  one sandbox and say whether every test passed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from areal.utils.sandbox.config import SandboxResult
from areal.utils.sandbox.runner import Sandbox

__all__ = ["PythonTool", "TestOutcome", "run_tests_against", "run_tests_against_sync"]

_STDERR_TAIL = 2000


def format_for_agent(result: SandboxResult) -> str:
    """The text a tool-integrated-reasoning agent is shown for one run."""
    if result.ok:
        return result.stdout + ("\n[output truncated]" if result.stdout_truncated else "")
    text = f"Error: {result.error}"
    tail = result.stderr.strip()[-_STDERR_TAIL:]
    if tail:
        text += "\n" + tail
    elif result.stdout.strip():
        text += "\n" + result.stdout.strip()[-_STDERR_TAIL:]
    return text


class PythonTool:
    """Function tool ``python``: ``await tool(code=...)`` returns the text for the model."""

    name = "python"
    description = (
        "Run a Python 3 program in an isolated sandbox (no network, no files outside its "
        "working directory, time and memory limits) and return what it prints."
    )

    def __init__(self, sandbox: Sandbox | None = None, timeout: float | None = None):
        self.sandbox = sandbox or Sandbox()
        self.timeout = timeout

    @property
    def schema(self) -> dict:
        """The OpenAI ``tools=[...]`` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python code"}},
                    "required": ["code"],
                },
            },
        }

    async def __call__(self, code: str) -> str:
        return format_for_agent(await self.sandbox.run_python(code, timeout=self.timeout))


@dataclass
class TestOutcome:
    """``passed``: the tests ran to the end and every assertion held."""

    passed: bool
    result: SandboxResult


async def run_tests_against(
    code: str, tests: str, sandbox: Sandbox, timeout: float | None = None
) -> TestOutcome:
    """Run ``code`` then ``tests`` (plain ``assert`` statements or calls that raise on
    failure) as one program; passed when it exits 0 within every limit and reaches the
    end of the tests (a ``sys.exit(0)`` or ``os._exit(0)`` in the code does not pass)."""
    marker = "__areal_sandbox_tests_passed__"
    program = f"{code}\n\n{tests}\n\nprint({marker!r})\n"
    result = await sandbox.run_python(program, timeout=timeout)
    last = result.stdout.rstrip().rsplit("\n", 1)[-1] if result.stdout.strip() else ""
    return TestOutcome(passed=result.ok and last == marker, result=result)


def run_tests_against_sync(
    code: str, tests: str, sandbox: Sandbox, timeout: float | None = None
) -> TestOutcome:
    """:func:`run_tests_against` for synchronous callers such as reward functions (which
    run in the reward worker processes, outside any event loop)."""
    return asyncio.run(run_tests_against(code, tests, sandbox, timeout))
