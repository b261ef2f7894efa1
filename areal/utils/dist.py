"""Process-group helpers shared by the trainer and the inference side.

``init_custom_process_group`` builds a process group that is *not* the default
``torch.distributed`` world: e.g. the weight-update group made of training rank 0 (group
rank 0, broadcast root) and the inference-server workers (group ranks 1..n). Both sides
call it with the same ``host``/``port``/``world_size``/``group_name``; rank 0 hosts the
``TCPStore``. It works whether or not the calling process has a default process group.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

__all__ = ["find_free_port", "init_custom_process_group", "broadcast_tensor"]

_STORES: dict[tuple, dist.Store] = {}


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _address_towards(host: str) -> str | None:
    """This machine's address on the route to ``host`` (no packet is sent); ``None`` when
    there is no such route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def init_custom_process_group(
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str = "areal_weight_update",
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join (rank 0: create) a standalone process group over ``TCPStore(host, port)``.

    ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; the caller sets
    the CUDA device first). Blocks until all ``world_size`` ranks have joined or
    ``timeout_s`` passes; ``timeout_s`` also bounds every later collective on the group.
    Returns the ``ProcessGroup``; send with
    :func:`broadcast_tensor` or ``pg.broadcast(tensor, root=0).wait()``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; allowed: 'gloo', 'nccl'")
    if world_size < 2:
        raise ValueError(f"world_size={world_size}; a weight-update group needs >= 2 ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside [0, world_size={world_size})")
    if not port:
        raise ValueError("port must be a fixed, non-zero port agreed by every rank")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, int(port), world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=True
    )
    prefixed = dist.PrefixStore(group_name, store)
    local = None
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
        local = _address_towards(host)
    if backend == "gloo" and local is None:
        pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "gloo":
        # gloo advertises the address its hostname resolves to (127.0.0.1 on many nodes);
        # use the interface that reaches the store's host instead, so ranks on other
        # nodes can connect back (GLOO_SOCKET_IFNAME, when set, decides as usual)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    # Keep the store alive as long as the group may be used.
    _STORES[(group_name, rank, id(pg))] = store
    return pg


def broadcast_tensor(pg: dist.ProcessGroup, tensor: torch.Tensor, root: int = 0) -> None:
    """Broadcast ``tensor`` in place over ``pg`` from group rank ``root`` and wait."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()
