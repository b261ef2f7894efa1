"""A sandbox for model-written Python: TIR-style tool calls and rewards that run tests.

It lives in ``areal/utils`` because both sides use it: agent workflows
(``areal/workflow``, the agent examples) call it as a tool and reward functions
(``areal/reward``) run tests with it; neither may depend on the other, and ``utils``
depends on neither. One package, one job per module:

- :mod:`~areal.utils.sandbox.config`: :class:`SandboxConfig` (limits),
  :class:`SandboxResult`, :class:`SandboxUnavailableError`;
- :mod:`~areal.utils.sandbox.runner`: :class:`Sandbox` (probe, spawn, caps, reasons);
- ``launch_pid1.py``: the stdlib script that is PID 1 inside the namespaces (it confines
  the filesystem and drops privileges before it execs the snippet);
- :mod:`~areal.utils.sandbox.tools`: the ``python`` function tool and
  :func:`run_tests_against` / :func:`run_tests_against_sync`, the helpers for rewards.

See ``docs/customization/sandbox.md``.
"""

from areal.utils.sandbox.config import SandboxConfig, SandboxResult, SandboxUnavailableError
from areal.utils.sandbox.runner import Sandbox
from areal.utils.sandbox.tools import (
    PythonTool,
    TestOutcome,
    run_tests_against,
    run_tests_against_sync,
)

__all__ = [
    "PythonTool",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailableError",
    "TestOutcome",
    "run_tests_against",
    "run_tests_against_sync",
]
