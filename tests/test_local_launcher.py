"""The local launcher relaunches a crashed controller up to recover.retries times."""

from __future__ import annotations

import textwrap
import time

from areal.infra.launcher.local import main, read_recover_settings


def _flaky_script(tmp_path, fail_times: int) -> str:
    counter = tmp_path / "attempts"
    script = tmp_path / "flaky.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import pathlib, sys
            p = pathlib.Path({str(counter)!r})
            n = int(p.read_text()) if p.exists() else 0
            p.write_text(str(n + 1))
            sys.exit(1 if n < {fail_times} else 0)
            """
        )
    )
    return str(script)


def _yaml(tmp_path, mode: str, retries: int) -> str:
    y = tmp_path / "c.yaml"
    y.write_text(f"recover:\n  mode: {mode}\n  retries: {retries}\n")
    return str(y)


def test_read_recover_settings_overrides_beat_yaml(tmp_path):
    y = _yaml(tmp_path, "disabled", 3)
    assert read_recover_settings(["--config", y]) == ("disabled", 3)
    assert read_recover_settings(["--config", y, "recover.mode=auto", "recover.retries=5"]) == (
        "auto",
        5,
    )


def test_launcher_crash_twice_with_auto_recover_relaunches_until_success(tmp_path):
    script = _flaky_script(tmp_path, fail_times=2)
    t0 = time.monotonic()
    rc = main([script, "--config", _yaml(tmp_path, "auto", 3)], backoff_s=0.5)
    assert rc == 0
    assert (tmp_path / "attempts").read_text() == "3"
    assert time.monotonic() - t0 >= 2 * 0.5  # the back-off ran before each relaunch


def test_launcher_retries_exhausted_returns_failure_code(tmp_path):
    script = _flaky_script(tmp_path, fail_times=5)
    rc = main([script, "--config", _yaml(tmp_path, "auto", 1)], backoff_s=0.0)
    assert rc == 1
    assert (tmp_path / "attempts").read_text() == "2"


def test_launcher_recover_disabled_never_relaunches(tmp_path):
    script = _flaky_script(tmp_path, fail_times=1)
    rc = main([script, "--config", _yaml(tmp_path, "disabled", 3)])
    assert rc == 1
    assert (tmp_path / "attempts").read_text() == "1"
