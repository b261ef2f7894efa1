"""``post_exit_hook`` (AReaL's launcher shutdown hook): the local, Ray and Slurm launchers
run it once the run has ended, with ``LOG_DIR`` = the run's log directory; its failure or
timeout is logged and never changes the run's exit code."""

from __future__ import annotations

import logging
import os
import subprocess
import textwrap

from areal.infra.launcher import common, local, ray, slurm


def _script(tmp_path, fail_times: int) -> str:
    """A controller that exits 3 on its first ``fail_times`` runs, then 0, counting runs."""
    counter = tmp_path / "attempts"
    script = tmp_path / "ctl.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import pathlib, sys
            p = pathlib.Path({str(counter)!r})
            n = int(p.read_text()) if p.exists() else 0
            p.write_text(str(n + 1))
            sys.exit(3 if n < {fail_times} else 0)
            """
        )
    )
    return str(script)


def _args(tmp_path, hook: str, *extra: str) -> list[str]:
    y = tmp_path / "c.yaml"
    y.write_text(
        "experiment_name: exp\ntrial_name: t1\n"
        f"cluster: {{fileroot: {str(tmp_path / 'root')!r}}}\n"
        f"post_exit_hook: {hook!r}\n"
    )
    return ["--config", str(y), *extra]


def _hook_writing(tmp_path) -> tuple[str, str]:
    out = tmp_path / "hook.out"
    # appends one line per run: LOG_DIR and the attempts the controller had made by then
    return f'echo "$LOG_DIR $(cat {tmp_path / "attempts"})" >> {out}', str(out)


def test_local_launcher_runs_the_hook_once_after_the_retries_with_log_dir(tmp_path):
    hook, out = _hook_writing(tmp_path)
    args = _args(tmp_path, hook, "recover.mode=auto", "recover.retries=2")
    rc = local.main([_script(tmp_path, fail_times=1), *args], backoff_s=0.0)
    assert rc == 0
    log_dir = os.path.join(str(tmp_path / "root"), "logs", "exp", "t1")
    # once, after the relaunch (2 attempts made), LOG_DIR the run's log directory
    assert open(out).read().splitlines() == [f"{log_dir} 2"]
    assert common.run_log_dir(args) == log_dir


def test_failing_hook_is_logged_and_keeps_the_runs_exit_code(tmp_path, caplog):
    args = _args(tmp_path, "echo on-stderr >&2; exit 7")
    with caplog.at_level(logging.WARNING):
        rc = local.main([_script(tmp_path, fail_times=5), *args])
    assert rc == 3  # the controller's code, not the hook's
    assert "post_exit_hook exited with code 7" in caplog.text
    assert "on-stderr" in caplog.text
    assert common.run_post_exit_hook(_args(tmp_path, "  ")) is None  # blank: no hook


def test_hook_past_its_timeout_is_left_with_a_warning(tmp_path, caplog):
    args = _args(tmp_path, "sleep 30")
    with caplog.at_level(logging.WARNING):
        assert common.run_post_exit_hook(args, timeout_s=0.5) is None
    assert "did not finish within" in caplog.text


def test_ray_launcher_runs_the_hook_after_the_script(tmp_path):
    hook, out = _hook_writing(tmp_path)
    rc = ray.main([_script(tmp_path, fail_times=1), *_args(tmp_path, hook)])
    assert rc == 3
    assert open(out).read().split()[-1] == "1"


def test_slurm_job_runs_the_hook_after_the_controller_and_exits_with_its_code(tmp_path):
    hook, out = _hook_writing(tmp_path)
    args = _args(tmp_path, hook)
    log_dir = common.run_log_dir(args)
    text = slurm.build_script(_script(tmp_path, fail_times=1), args, log_dir)
    assert "exec " not in text and text.rstrip().endswith("exit $rc")
    job = tmp_path / "job.sh"
    job.write_text(text)
    # the batch script as a Slurm node would run it (the #SBATCH lines are comments)
    rc = subprocess.run(["bash", str(job)], cwd=os.getcwd()).returncode
    assert rc == 3
    assert open(out).read().splitlines() == [f"{log_dir} 1"]
    # without a hook the controller is exec'd, as before
    plain = slurm.build_script("ctl.py", _args(tmp_path, ""), log_dir)
    assert "\nexec " in plain and "launcher.common" not in plain
