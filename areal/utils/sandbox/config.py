"""The sandbox's limits (:class:`SandboxConfig`), one run's outcome (:class:`SandboxResult`)
and the error raised when the OS cannot confine a snippet (:class:`SandboxUnavailableError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailableError"]


class SandboxUnavailableError(RuntimeError):
    """The OS does not let the sandbox create its namespaces; nothing is run unconfined."""


@dataclass
class SandboxConfig:
    """Limits of one snippet run by :class:`~areal.utils.sandbox.runner.Sandbox`."""

    wall_time_s: float = field(
        default=10.0,
        metadata={"help": "Wall-clock limit; the whole namespace is killed at it."},
    )
    cpu_time_s: int = field(
        default=5,
        metadata={"help": "CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL 1 s later)."},
    )
    memory_mb: int = field(
        default=1024,
        metadata={"help": "Address space per process in MiB (RLIMIT_AS): MemoryError beyond it."},
    )
    max_processes: int = field(
        default=32,
        metadata={
            "help": "Processes and threads of the sandbox uid (RLIMIT_NPROC; counted per uid "
            "across the host, so concurrent snippets sharing a uid share it)."
        },
    )
    max_output_bytes: int = field(
        default=1 << 20,
        metadata={"help": "Bytes kept of stdout and of stderr each; more kills the run."},
    )
    file_size_mb: int = field(
        default=64,
        metadata={"help": "Size of the private work directory (tmpfs) and RLIMIT_FSIZE, MiB."},
    )
    max_open_files: int = field(default=256, metadata={"help": "RLIMIT_NOFILE."})
    uid: int = field(
        default=65534,
        metadata={"help": "Unprivileged uid the snippet runs as (65534: nobody)."},
    )
    gid: int = field(default=65534, metadata={"help": "Its gid (65534: nogroup)."})
    uid_pool_size: int = field(
        default=1,
        metadata={
            "help": "Consecutive uids from `uid` handed round-robin to concurrent snippets, "
            "so that a fork bomb in one does not exhaust another's process limit."
        },
    )
    hidden_paths: tuple[str, ...] = field(
        default=("/root", "/home"),
        metadata={
            "help": "Directories covered by an empty tmpfs inside the sandbox (the "
            "interpreter's own prefix under one of them stays visible, read-only)."
        },
    )
    python: str | None = field(
        default=None,
        metadata={"help": "Interpreter for snippets; None: this process's sys.executable."},
    )
    unshare_binary: str = field(
        default="unshare",
        metadata={"help": "util-linux `unshare` (a name looked up on PATH, or a path)."},
    )

    def __post_init__(self):
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_output_bytes", "file_size_mb", "max_open_files", "uid_pool_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.uid <= 0 or self.gid <= 0:
            raise ValueError(
                f"SandboxConfig.uid/gid must be unprivileged (> 0), got {self.uid}/{self.gid}"
            )


@dataclass
class SandboxResult:
    """What one snippet did. ``error`` is None when it exited 0 within every limit;
    otherwise one of ``"timeout"``, ``"cpu time limit"``, ``"memory limit"``,
    ``"process limit"``, ``"output limit"``, ``"file size limit"``, ``"killed by signal N"``,
    ``"exit code N"`` or ``"sandbox setup failed: ..."``."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    cpu_time_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None
