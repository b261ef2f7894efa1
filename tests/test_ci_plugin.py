"""tests/_ci_plugin.py in real inner pytest runs: the time budget, per-file durations and
the CI skip policy (two runs of a small suite: under CI with a tiny budget, and without)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

SUITE = {
    "conftest.py": f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        from _ci_plugin import CIPlugin

        def pytest_configure(config):
            for m in ("gpu", "vllm_cpu", "areal_checkout"):
                config.addinivalue_line("markers", m)
            config.pluginmanager.register(CIPlugin(), "areal-ci")
    """,
    "test_sleepy.py": """
        import time

        def test_sleeps_past_the_budget():
            time.sleep(1.5)
    """,
    "test_quick.py": """
        def test_quick():
            assert True
    """,
    "test_skips.py": """
        import pytest

        def test_plain_skip():
            pytest.skip("prerequisite missing")

        @pytest.mark.gpu
        def test_gpu_skip():
            pytest.skip("needs CUDA")

        @pytest.mark.vllm_cpu
        def test_vllm_skip():
            pytest.skip("needs vLLM")

        @pytest.mark.areal_checkout
        def test_areal_skip():
            pytest.skip("needs AReaL")
    """,
    "test_module_skip.py": """
        import pytest

        pytest.importorskip("a_module_that_is_not_installed")
    """,
}


def _run_inner(tmp_path, *args: str, **env) -> tuple[int, str]:
    for name, body in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    full_env = {k: v for k, v in os.environ.items() if k not in ("CI", "AREAL_TEST_BUDGET_S")}
    full_env.update(env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, r.stdout + r.stderr


def test_ci_run_over_budget_fails_naming_slowest_file_and_forbidden_skips(tmp_path):
    # (a module that skips at import is a collection error: it stops the session unless
    # told to go on)
    rc, out = _run_inner(
        tmp_path, "--continue-on-collection-errors", CI="1", AREAL_TEST_BUDGET_S="0.5"
    )
    assert rc == 1, out
    # the budget: every test that ran passed, the session fails, slowest file first
    summary = out.split("time budget exceeded", 1)[1]
    assert "over the budget AREAL_TEST_BUDGET_S=0.5 s" in summary
    listed = [ln.split()[-1] for ln in summary.splitlines() if ln.strip().endswith(".py")]
    assert listed[0] == "test_sleepy.py", summary
    # the skip policy: only the gpu / vllm_cpu / areal_checkout tests may skip
    assert "2 passed" in out and "1 failed" in out and "3 skipped" in out, out
    assert "FAILED test_skips.py::test_plain_skip" in out
    assert "ERROR test_module_skip.py" in out


def test_plain_run_within_budget_passes_and_prints_per_file_durations(tmp_path):
    rc, out = _run_inner(tmp_path, AREAL_TEST_BUDGET_S="60")
    assert rc == 0, out
    assert "2 passed, 5 skipped" in out, out
    table = out.split("durations per file", 1)[1]
    rows = [ln.split() for ln in table.splitlines() if ln.strip().endswith(".py")]
    assert rows[0][-1] == "test_sleepy.py" and float(rows[0][0]) >= 1.5, table
    assert {r[-1] for r in rows} == {"test_sleepy.py", "test_quick.py", "test_skips.py"}
    assert "time budget exceeded" not in out
