"""Launching inference servers through a scheduler.

The inference part of the allocation mode (``local:d2``, ``vllm:d2t2``, ``sglang:d1``)
becomes ``dp`` server processes of role ``rollout``, each a *command worker* of the
scheduler (same logging, health check and teardown as training workers). The command of
one server is given by the caller (the backend registry
``areal.inference.backends.server_command``); this module knows no backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal.api.alloc_mode import AllocationMode
from areal.api.cli_args import SchedulingSpec
from areal.api.scheduler_api import Job, WorkerDiedError
from areal.utils import logging

if TYPE_CHECKING:
    from areal.api.experiment_config import PPOConfig

logger = logging.getLogger("ServerLauncher")

ROLE = "rollout"


def launch_server_workers(
    scheduler: Any,
    n_servers: int,
    command: str,
    env: dict[str, str] | None = None,
    gpus_per_server: int = 0,
    timeout: float = 300.0,
    role: str = ROLE,
    health_path: str = "/health",
    start_attempts: int = 3,
    placement: SchedulingSpec | None = None,
) -> list[str]:
    """Start ``n_servers`` command workers of ``role`` running ``command`` (placeholders
    ``{host}``/``{port}``); returns their ``host:port`` addresses once healthy. A server
    that dies during start-up makes the whole role start again, up to ``start_attempts``
    times in all. ``placement`` (the role's configured scheduling spec, e.g.
    ``rollout.scheduling_spec[0]``) supplies the node constraints ``nodelist`` /
    ``exclude``; resources and command come from the arguments."""
    if n_servers < 1:
        raise ValueError(f"n_servers={n_servers}; need >= 1")
    spec = SchedulingSpec(
        cpu=1,
        gpu=gpus_per_server,
        mem=4,
        port_count=1,
        cmd=command,
        env_vars=dict(env or {}),
        nodelist=getattr(placement, "nodelist", None),
        exclude=getattr(placement, "exclude", None),
    )
    job = Job(
        replicas=n_servers, tasks=[spec], role=role, health_path=health_path, distributed_env=False
    )
    logger.info(f"Starting {n_servers} inference server(s) as role {role!r}: {command}")
    for attempt in range(1, start_attempts + 1):
        try:
            scheduler.create_workers(job, timeout=timeout)
            workers = scheduler.get_workers(role, timeout=timeout)
            return [w.address for w in workers]
        except WorkerDiedError as e:
            # a server killed while starting (OOM killer, an operator, a chaos test) must
            # not end the run: stop what is left of the role and start them all again
            if attempt == start_attempts:
                raise
            logger.warning(
                f"an inference server died during start-up ({str(e).splitlines()[0]}); "
                f"starting the {n_servers} server(s) again (attempt {attempt + 1}/{start_attempts})"
            )
            try:
                scheduler.delete_workers(role)
            except Exception as stop_error:  # noqa: BLE001 - the retry reports what matters
                logger.warning(f"stopping the rest of role {role!r} failed: {stop_error}")
    raise AssertionError("unreachable")


def launch_inference_servers(
    scheduler: Any,
    alloc_mode: AllocationMode,
    command: str,
    env: dict[str, str] | None = None,
    config: PPOConfig | None = None,
    role: str = ROLE,
    health_path: str = "/health",
) -> list[str]:
    """Start the ``dp`` servers named by ``alloc_mode`` with ``command`` (placeholders
    ``{host}``/``{port}``) and return their ``host:port`` addresses.

    ``config`` (the experiment config) gives ``cluster.n_gpus_per_node`` (0: no GPUs
    requested) and ``rollout.setup_timeout``.
    """
    backend = alloc_mode.gen_backend
    gen = alloc_mode.gen
    if backend is None or gen is None:
        raise ValueError(
            f"allocation_mode {str(alloc_mode)!r} names no inference servers (e.g. 'local:d1+fsdp:d1')"
        )
    n_gpus = config.cluster.n_gpus_per_node if config is not None else 0
    specs = (config.rollout.scheduling_spec or []) if config is not None else []
    return launch_server_workers(
        scheduler,
        n_servers=gen.dp_size,
        command=command,
        env=env,
        gpus_per_server=alloc_mode.gen_instance_size if n_gpus > 0 else 0,
        timeout=float(config.rollout.setup_timeout if config is not None else 300.0),
        role=role,
        health_path=health_path,
        placement=specs[0] if specs else None,
    )
