"""Spawn real gloo ranks (and helper processes) for tests; always tears them down.

``run_ranks(fn, world_size, args)`` starts ``world_size`` spawned processes with
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set (127.0.0.1,
free port), one torch thread each, calls ``fn(rank, world_size, *args)`` in each and
returns the list of results by rank. ``extra=[(fn, args), ...]`` runs more processes
(no distributed env) whose results come back in ``results["extra"]``. Any exception in
any process is re-raised in the test with its traceback; every process is killed on exit.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(tag: Any, fn: Callable, env: dict[str, str], args: tuple, q: Any) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        res = fn(*args)
        # Serialise here: tensors sent through a Queue would live in shared memory that
        # disappears when this process exits.
        buf = io.BytesIO()
        torch.save(res, buf)
        q.put((tag, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((tag, "err", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    extra: Sequence[tuple[Callable, Sequence[Any]]] = (),
) -> dict[Any, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns {rank: result, "extra": [...]}."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = []
    try:
        for r in range(world_size):
            env = {
                "RANK": str(r),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            p = ctx.Process(
                target=_entry, args=(r, fn, env, (r, world_size, *args), q), daemon=True
            )
            p.start()
            procs.append(p)
        for i, (efn, eargs) in enumerate(extra):
            p = ctx.Process(
                target=_entry, args=(("extra", i), efn, {}, tuple(eargs), q), daemon=True
            )
            p.start()
            procs.append(p)
        results: dict[Any, Any] = {}
        extra_res: dict[int, Any] = {}
        n = world_size + len(extra)
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(extra_res) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout}s")
            try:
                tag, status, res = q.get(timeout=min(left, 2.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a test process died with exit code {dead[0].exitcode} without reporting"
                    ) from None
                continue
            if status == "err":
                raise RuntimeError(f"process {tag} failed:\n{res}")
            import torch

            res = torch.load(io.BytesIO(res), weights_only=False)
            if isinstance(tag, tuple):
                extra_res[tag[1]] = res
            else:
                results[tag] = res
        results["extra"] = [extra_res[i] for i in range(len(extra))]
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()
