import json
import subprocess
import sys

import pytest

from areal.tools import validate_installation as vi


def test_validate_installation_missing_required_module_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(vi, "REQUIRED_MODULES", ("torch", "no_such_module_xyz"))
    monkeypatch.setattr(vi, "OPTIONAL_MODULES", ("another_missing_mod_xyz",))
    rc = vi.main(["--skip-model", "--json"])
    report = json.loads(capsys.readouterr().out)
    by_name = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and report["ok"] is False
    assert by_name["torch"]["status"] == "OK"
    assert by_name["no_such_module_xyz"]["status"] == "MISSING"
    assert by_name["another_missing_mod_xyz"]["required"] is False


def test_validate_installation_optional_missing_only_exits_zero(monkeypatch, capsys):
    monkeypatch.setattr(vi, "REQUIRED_MODULES", ("json",))
    monkeypatch.setattr(vi, "OPTIONAL_MODULES", ("another_missing_mod_xyz",))
    assert vi.main(["--skip-model"]) == 0
    assert "RESULT: OK" in capsys.readouterr().out


@pytest.mark.slow
def test_validate_installation_cli_here_tiny_model_generates_ok():
    proc = subprocess.run(
        [sys.executable, "-m", "areal.tools.validate_installation", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    report = json.loads(proc.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert by_name["tiny_model"]["status"] == "OK"
    assert by_name["torch"]["status"] == "OK"
