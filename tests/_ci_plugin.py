"""pytest plugin of the test suite: the CI skip policy, per-file durations, a time budget.

Registered by ``tests/conftest.py`` (``pytest_configure``). Three jobs, in this order:

1. **No silent skips under CI.** With the ``CI`` environment variable set (any non-empty
   value but ``0``/``false``/``no``; ``.ci/run`` sets ``CI=1``), every skipped test FAILS,
   except tests carrying one of the markers in :data:`ALLOWED_SKIP_MARKERS`: the three
   kinds that cannot run on a fresh clone here (CUDA, vLLM's CPU build, an AReaL
   checkout). A skip raised while collecting a module (``pytest.skip(allow_module_level)``,
   a failed ``importorskip``) fails too.
2. **Per-file durations.** Setup + call + teardown of every test are summed per file and
   printed, slowest first, at the end of the session (``AREAL_TEST_DURATIONS=0`` hides the
   table).
3. **Time budget.** With ``AREAL_TEST_BUDGET_S`` set (seconds, ``make check`` sets it from
   ``TEST_BUDGET_S``), a session that took longer (wall time, from its start to its end:
   the files run on several processes under ``pytest -n``, so the per-file sum is larger)
   fails, naming the slowest files.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

ALLOWED_SKIP_MARKERS = ("gpu", "vllm_cpu", "areal_checkout")
_SLOWEST_LISTED = 10


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[-1])
    return str(report.longrepr)


class CIPlugin:
    def __init__(self) -> None:
        self.per_file: dict[str, float] = defaultdict(float)
        self.allowed: dict[str, bool] = {}
        budget = os.environ.get("AREAL_TEST_BUDGET_S", "").strip()
        self.budget_s = float(budget) if budget else None
        self.over_budget = False
        self.started = time.monotonic()  # registered at pytest_configure: the session's start
        self.wall_s = 0.0

    # ------------------------------------------------------------------ skip policy
    def pytest_collection_modifyitems(self, items):
        for item in items:
            self.allowed[item.nodeid] = any(
                item.get_closest_marker(m) is not None for m in ALLOWED_SKIP_MARKERS
            )

    def _fail_if_forbidden(self, report, allowed: bool) -> None:
        if not (in_ci() and report.skipped) or hasattr(report, "wasxfail") or allowed:
            return
        reason = _skip_reason(report)
        report.outcome = "failed"
        report.longrepr = (
            f"CI is set: only tests marked {'/'.join(ALLOWED_SKIP_MARKERS)} may skip; "
            f"this one skipped: {reason}"
        )

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        self._fail_if_forbidden(outcome.get_result(), self.allowed.get(item.nodeid, False))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_make_collect_report(self, collector):
        outcome = yield
        allowed = any(
            next(collector.iter_markers(m), None) is not None for m in ALLOWED_SKIP_MARKERS
        )
        self._fail_if_forbidden(outcome.get_result(), allowed)

    # ------------------------------------------------------------------ durations
    def pytest_runtest_logreport(self, report):
        self.per_file[report.nodeid.split("::", 1)[0]] += report.duration

    def _slowest(self) -> list[tuple[str, float]]:
        return sorted(self.per_file.items(), key=lambda kv: -kv[1])

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        self.wall_s = time.monotonic() - self.started
        if self.budget_s is not None and self.wall_s > self.budget_s:
            self.over_budget = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if not self.per_file:
            return
        tr = terminalreporter
        total = sum(self.per_file.values())
        if os.environ.get("AREAL_TEST_DURATIONS", "1") != "0":
            tr.section("durations per file (setup + call + teardown)")
            for path, secs in self._slowest():
                tr.write_line(f"{secs:9.1f} s  {path}")
            tr.write_line(f"{total:9.1f} s  total ({len(self.per_file)} files)")
            tr.write_line(f"{self.wall_s:9.1f} s  wall time of the session")
        if self.over_budget:
            tr.section("time budget exceeded", red=True)
            tr.write_line(
                f"the session took {self.wall_s:.1f} s, over the budget AREAL_TEST_BUDGET_S="
                f"{self.budget_s:g} s; slowest files:",
                red=True,
            )
            for path, secs in self._slowest()[:_SLOWEST_LISTED]:
                tr.write_line(f"{secs:9.1f} s  {path}", red=True)
