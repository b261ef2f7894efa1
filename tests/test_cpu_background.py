"""tools/cpu_background.py: `make check` runs `make claims` with it beside the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "cpu_background.py")

# The command: starts a sleeper in a session of its own (as servers and workers do),
# records its pid and its own cgroups and nice value, and exits 3.
CHILD = textwrap.dedent(
    """
    import os, subprocess, sys
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(f"{p.pid}\\n{os.nice(0)}\\n" + open(f"/proc/{p.pid}/cgroup").read())
    sys.exit(3)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_command_runs_at_low_weight_exit_status_kept_leftovers_killed(tmp_path):
    child, out = tmp_path / "child.py", tmp_path / "out"
    child.write_text(CHILD)
    done = subprocess.run(
        [sys.executable, TOOL, "--shares", "64", "--", sys.executable, str(child), str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr  # the command's own exit status
    first = done.stdout.splitlines()[0]
    pid_line, nice_line, *cgroups = out.read_text().splitlines()
    sleeper = int(pid_line)
    if first.startswith("cpu_background: cgroup "):
        group = first.split()[2]
        assert "(cpu.shares 64)" in first
        # the sleeper started a session of its own and is still in the group
        assert any(os.path.basename(group) in line for line in cgroups), cgroups
        # ... and did not outlive the command: killed, the group removed
        deadline = time.monotonic() + 10
        while _alive(sleeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(sleeper)
        assert not os.path.exists(group)
    else:
        # no writable cpu cgroup: nice 19 is what is left
        assert first.startswith("cpu_background: no writable cpu cgroup"), first
        assert int(nice_line) == 19
        os.kill(sleeper, signal.SIGKILL)


def test_no_command_is_a_usage_error():
    done = subprocess.run([sys.executable, TOOL, "--"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no command given" in done.stderr
