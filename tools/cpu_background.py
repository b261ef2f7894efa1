"""Run a command at a low CPU weight, so that it only takes CPU other jobs leave idle.

    python tools/cpu_background.py [--shares N] -- COMMAND [ARG ...]

What happens:

1. A CPU cgroup ``areal-bg-<pid>`` is made under cgroup v1's ``cpu`` hierarchy with
   ``cpu.shares`` N (default 128; a nice-0 group has 1024), or under cgroup v2 with
   ``cpu.weight`` N * 100 / 1024 (at least 1), and this process moves into it.
2. COMMAND runs there; every process it starts stays there, whatever it does with
   sessions or nice values. That is why a cgroup and not ``nice``: with the kernel's
   autogroups (``sched_autogroup_enabled=1``) every new session (``start_new_session``,
   which servers and workers use) gets a nice-0 group of its own, and ``nice 19`` then
   holds only inside the session that set it.
3. When COMMAND exits (or this process gets SIGTERM / SIGINT, which it passes on to
   COMMAND first), every process still in the cgroup is killed (a run's servers and
   workers do not outlive an interrupted ``make check``), this process moves back and
   removes the cgroup. The exit status is COMMAND's.

Where no cgroup can be made (no writable ``cpu`` controller: an unprivileged container),
COMMAND runs in a new session whose autogroup is set to nice 19, and at nice 19 itself
(what the kernel allows without cgroups; the processes that start sessions of their own
escape it). The line printed first says which one applied.

``make check`` runs ``make claims`` this way beside the ``serial`` test files, whose
fault timeouts leave the CPU idle most of the time.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

V1_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def _own_cgroup(controller: str | None) -> str:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (v2: None)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or controller in ctrls.split(","):
                return path
    raise OSError(f"no {controller or 'v2'} entry in /proc/self/cgroup")


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def make_cgroup(shares: int) -> tuple[str, str] | None:
    """Create the cgroup, move this process into it; (its dir, the dir to move back to)."""
    name = f"areal-bg-{os.getpid()}"
    if os.path.exists(os.path.join(V1_ROOT, "cpu.shares")):
        parent = os.path.join(V1_ROOT, _own_cgroup("cpu").lstrip("/"))
        group = os.path.join(parent, name)
        try:
            os.mkdir(group)
            _write(os.path.join(group, "cpu.shares"), str(shares))
            _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
            return group, parent
        except OSError:
            _remove(group)
    for root in V2_ROOTS:
        try:
            parent = os.path.join(root, _own_cgroup(None).lstrip("/"))
        except OSError:
            continue
        if not os.path.exists(os.path.join(parent, "cgroup.subtree_control")):
            continue
        group = os.path.join(parent, name)
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "cpu" not in f.read().split():
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
            os.mkdir(group)
            _write(os.path.join(group, "cpu.weight"), str(max(1, shares * 100 // 1024)))
            _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
            return group, parent
        except OSError:
            _remove(group)
    return None


def _remove(group: str) -> None:
    try:
        os.rmdir(group)
    except OSError:
        pass


def lower_priority_without_cgroup() -> None:
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    try:
        _write("/proc/self/autogroup", "19")
    except OSError:
        pass  # no autogroups
    os.nice(19 - os.nice(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shares", type=int, default=128, help="cgroup v1 cpu.shares (2-262144)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (cpu_background.py [--shares N] -- COMMAND ...)")
    if not 2 <= args.shares <= 262144:
        parser.error(f"--shares must be in 2..262144, got {args.shares}")
    made = make_cgroup(args.shares)
    if made:
        print(f"cpu_background: cgroup {made[0]} (cpu.shares {args.shares})", flush=True)
    else:
        lower_priority_without_cgroup()
        print("cpu_background: no writable cpu cgroup; nice 19 (+ autogroup nice 19)", flush=True)
    proc = subprocess.Popen(command)

    def forward(signum, _frame):
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return proc.wait()
    finally:
        if made:
            remove_cgroup(*made)


def remove_cgroup(group: str, parent: str) -> None:
    """Kill what is left in ``group``, move this process back to ``parent``, remove it."""
    me = os.getpid()
    _write(os.path.join(parent, "cgroup.procs"), str(me))
    for _ in range(50):
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                left = [int(p) for p in f.read().split()]
        except OSError:
            return
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _remove(group)


if __name__ == "__main__":
    sys.exit(main())
