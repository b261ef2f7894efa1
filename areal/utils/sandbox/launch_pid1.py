"""PID 1 of one sandbox: confine the filesystem, then run the snippet as an unprivileged uid.

A standalone stdlib script (it imports nothing from ``areal``), started by
:mod:`areal.utils.sandbox.runner` as ``unshare --net --pid --fork --mount --mount-proc
--ipc --uts [--user --map-root-user] -- python -I -B launch_pid1.py SPEC``, so it already runs
in fresh network, PID, mount, IPC and UTS namespaces, with a fresh ``/proc`` that shows
only this namespace's processes. The snippet arrives on stdin; ``SPEC`` is a JSON object
(limits, uid/gid, paths). What happens, in order:

1. read the snippet from stdin (then stdin is ``/dev/null`` for the snippet), fork the
   child that will run it and wait until it is ready (as a normal user: it has entered
   a nested user namespace that maps only the sandbox uid, see step 5);
2. mount an empty tmpfs on ``/tmp`` (the host's ``/tmp`` is out of sight) and on each
   hidden path (``/root``, ``/home``), bringing back read-only the interpreter's prefixes
   that lie under one of them (a checkout's venv under ``/tmp`` included);
3. make every mount read-only (``mount_setattr(AT_RECURSIVE)``, or a remount of each);
4. mount a size-limited tmpfs at the work directory, owned by the sandbox uid, mode
   0700: the only writable place; write the snippet there;
5. let the child go: it sets the rlimits (CPU, address space, processes, file size, open
   files, no core), drops to the sandbox uid/gid with no supplementary groups (as real
   root: ``setgroups``/``setgid``/``setuid``; in a user namespace: ``setgid``/``setuid``
   in the nested one), and execs the interpreter on a bootstrap that reports
   ``MemoryError`` / failed forks through fd 3;
6. wait for the child (its CPU time from ``wait4``), read its fd 3 report, and write one
   JSON line to the runner's report pipe (``report_fd``). When this process exits the
   kernel kills whatever the snippet left behind in the PID namespace.
"""

import ctypes
import errno
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 32, 4096, 8192, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (asm-generic table)
CLONE_NEWUSER = 0x10000000

# Runs as the sandbox uid: the snippet as ``__main__``; a MemoryError or a failed
# fork/thread start is reported on fd 3 (the runner names the limit), then re-raised.
BOOTSTRAP = r"""
import os, sys
def _report(reason):
    try:
        os.set_blocking(3, False)
        os.write(3, reason.encode() + b"\n")
    except OSError:
        pass
_path = sys.argv[1]
sys.argv = [_path]
_g = {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__}
try:
    with open(_path, encoding="utf-8") as _f:
        _code = compile(_f.read(), _path, "exec")
    del _f
    exec(_code, _g)
except MemoryError:
    _report("memory limit")
    raise
except BlockingIOError:
    _report("process limit")
    raise
except RuntimeError as _e:
    if "can't start new thread" in str(_e):
        _report("process limit")
    raise
"""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _mount(source, target, fstype, flags, data=None):
    args = [None if a is None else a.encode() for a in (source, target, fstype)]
    if _libc.mount(*args, flags, None if data is None else data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {source} on {target} ({fstype}): {os.strerror(e)}")


def _mount_points():
    with open("/proc/self/mountinfo") as f:
        return [(line.split()[4], line.split()[5]) for line in f]


def _all_read_only():
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    rc = _libc.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    if rc == 0:
        return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
        e = ctypes.get_errno()
        raise OSError(e, f"mount_setattr(/, RDONLY, AT_RECURSIVE): {os.strerror(e)}")
    # Kernels before 5.12: remount each mount point read-only, keeping its lock flags.
    names = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    names.update(noatime=MS_NOATIME, nodiratime=MS_NODIRATIME, relatime=MS_RELATIME)
    for point, opts in _mount_points():
        keep = sum(names.get(o, 0) for o in opts.split(","))
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            if point == "/":
                raise


def _under(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")


def _workdir_owner(spec):
    # In a user namespace only our own uid is mapped (as 0); the nested namespace of
    # the snippet maps its uid onto it, so the snippet owns the directory either way.
    return (0, 0) if spec["user_namespace"] else (spec["uid"], spec["gid"])


def _confine_filesystem(spec):
    keep = [p for p in spec["keep_paths"] if os.path.isdir(p)]
    # a kept path under /tmp (a venv in a checkout there): opened before the tmpfs covers
    # /tmp, bound back from its descriptor afterwards
    under_tmp = [(os.open(p, os.O_RDONLY | os.O_DIRECTORY), p) for p in keep if _under(p, "/tmp")]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for fd, path in under_tmp:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    for hidden in spec["hidden_paths"]:
        if not os.path.isdir(hidden) or os.path.realpath(hidden) == "/":
            continue
        inside = [p for p in keep if _under(p, hidden)]
        staged = []
        for i, path in enumerate(inside):
            stage = f"/tmp/.keep{len(os.listdir('/tmp'))}_{i}"
            os.mkdir(stage)
            _mount(path, stage, None, MS_BIND | MS_REC)
            staged.append((stage, path))
        _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for stage, path in staged:
            os.makedirs(path, exist_ok=True)
            _mount(stage, path, None, MS_MOVE)
            os.rmdir(stage)
    os.mkdir(spec["workdir"], 0o700)
    _all_read_only()
    uid, gid = _workdir_owner(spec)
    size = f"size={spec['file_size_mb']}m,mode=0700,uid={uid},gid={gid}"
    _mount("tmpfs", spec["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, size)


def _enter_user_namespace(spec):
    """Inside a user namespace only our own uid is mapped (as 0): a nested one that maps
    the sandbox uid onto it (and nothing else) leaves the snippet without capabilities.
    Runs before ``/proc`` is made read-only (the maps are written there)."""
    if _libc.unshare(CLONE_NEWUSER) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    maps = (("setgroups", "deny"), ("uid_map", f"{spec['uid']} 0 1"))
    for name, text in (*maps, ("gid_map", f"{spec['gid']} 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _drop_privileges(spec):
    uid, gid = spec["uid"], spec["gid"]
    if not spec["user_namespace"]:
        os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    extra_groups = os.getgroups() and not spec["user_namespace"]
    if os.getuid() != uid or os.geteuid() != uid or extra_groups:
        raise OSError(errno.EPERM, "privileges were not dropped")


def _exec_snippet(spec, path, reason_w):
    os.close(spec["report_fd"])
    if reason_w != 3:
        os.dup2(reason_w, 3)
        os.close(reason_w)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    limits = spec["limits"]
    cpu = limits["cpu_time_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    nproc = limits["max_processes"]
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    fsize = spec["file_size_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _drop_privileges(spec)
    os.chdir(spec["workdir"])
    argv = [spec["python"], "-I", "-B", "-c", BOOTSTRAP, path]
    os.execve(spec["python"], argv, spec["env"])


def _child(spec, path, reason_w, ready_w, go_r):
    try:
        if spec["user_namespace"]:
            _enter_user_namespace(spec)
        os.write(ready_w, b"1")
        os.close(ready_w)
        if os.read(go_r, 1) != b"1":
            os._exit(126)
        os.close(go_r)
        _exec_snippet(spec, path, reason_w)
    except BaseException as e:  # noqa: BLE001 - report any setup failure, then die
        os.write(2, f"sandbox: cannot start the snippet: {e}\n".encode())
    os._exit(127)


def _setup_failed(spec, error):
    os.write(spec["report_fd"], (json.dumps({"setup_error": str(error)}) + "\n").encode())
    os._exit(1)


def main():
    spec = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read()
    path = os.path.join(spec["workdir"], "snippet.py")
    reason_r, reason_w = os.pipe()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (reason_r, ready_r, go_w):
            os.close(fd)
        _child(spec, path, reason_w, ready_w, go_r)
    for fd in (reason_w, ready_w, go_r):
        os.close(fd)
    try:
        if os.read(ready_r, 1) == b"1":
            _confine_filesystem(spec)
            with open(path, "wb") as f:
                f.write(code)
            os.chown(path, *_workdir_owner(spec))
            os.write(go_w, b"1")
    except OSError as e:
        _setup_failed(spec, e)  # exiting kills the waiting child with the namespace
    os.close(go_w)
    _, status, usage = os.wait4(pid, 0)
    report = {"cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit_code"] = os.WEXITSTATUS(status)
    os.set_blocking(reason_r, False)
    try:
        reasons = os.read(reason_r, 4096).decode(errors="replace").splitlines()
    except BlockingIOError:
        reasons = []
    report["reason"] = reasons[0] if reasons else None
    os.write(spec["report_fd"], (json.dumps(report) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
