"""Weight-update RPCs of ``RemoteInfEngine``: reload from disk, join the ``xccl`` group,
announce one bucket of a distributed update.

Each returns a ``concurrent.futures.Future`` (run on the engine's thread pool). When the
engine is not already paused, an update pauses every server, updates, sets the version
and continues (``_paused_update``). For a multi-bucket distributed update call
``pause_generation()`` first and ``continue_generation()`` after the last bucket (the
engine then leaves pausing alone).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.utils import logging

logger = logging.getLogger("RemoteInfEngine")


class WeightUpdateRPCMixin:
    """Weight updates of ``RemoteInfEngine`` (module docstring).

    Uses the engine's ``config``, ``backend``, ``_executor`` (thread pool), ``_paused``,
    ``disk_update_responses``, ``pause_generation``/``continue_generation``/``set_version``,
    ``healthy_addresses`` and ``_post``/``_call_all`` (``areal.infra.rollout.remote_http``).
    """

    def _submit(self, fn: Callable[[], Any]) -> Future:
        if self._executor is None:
            raise RuntimeError("RemoteInfEngine.initialize() was not called")
        return self._executor.submit(fn)

    def _paused_update(self, update: Callable[[], Any], version: int | None) -> Any:
        own_pause = not self._paused.is_set()
        if own_pause:
            self.pause_generation()
        try:
            result = update()
            if version is not None:
                self.set_version(version)
            return result
        finally:
            if own_pause:
                self.continue_generation()

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        if meta.type != "disk" or not meta.path:
            raise ValueError(
                "update_weights_from_disk needs a WeightUpdateMeta of type 'disk' with a path"
            )

        def _run():
            t0 = time.monotonic()
            # each server's answer, e.g. its weight fingerprint (areal.infra.weight_verify)
            self.disk_update_responses = responses = {}
            self._paused_update(
                lambda: self._call_all(
                    lambda i, a: self.backend.update_disk_call(meta.path, meta.version),
                    idempotent=True,
                    responses=responses,
                ),
                meta.version,
            )
            logger.info(
                "weights reloaded from %s (version %s) in %.2fs",
                meta.path,
                meta.version,
                time.monotonic() - t0,
            )

        return self._submit(_run)

    def _weight_update_http_timeout(self, meta: WeightUpdateMeta) -> float:
        # The server answers within ``meta.timeout_s`` (its join / broadcasts fail then):
        # wait a little longer so its error, not a client timeout, is what gets raised.
        return max(float(self.config.request_timeout), float(meta.timeout_s) + 15.0)

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future:
        """Make every server join the ``xccl`` group as ranks 1..n (sets ``meta.world_size``).

        The join is a rendezvous: the returned Future completes only once training rank 0
        joins too (within ``meta.timeout_s``), so start it *before* rank 0 joins and wait
        for both.
        """
        addrs = self.healthy_addresses
        world_size = 1 + len(addrs)
        if meta.world_size and meta.world_size != world_size:
            raise ValueError(
                f"meta.world_size={meta.world_size}, but 1 trainer + {len(addrs)} servers = {world_size}"
            )
        meta.world_size = world_size
        timeout = self._weight_update_http_timeout(meta)

        def _run():
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(addrs)) as pool:
                futs = [
                    pool.submit(
                        self._post,
                        a,
                        self.backend.init_group_call(meta, 1 + i, world_size),
                        timeout,
                    )
                    for i, a in enumerate(addrs)
                ]
                return [f.result() for f in futs]

        return self._submit(_run)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> Future:
        """Announce one bucket; the Future completes when every server has received it."""
        specs = list(param_specs)
        timeout = self._weight_update_http_timeout(meta)

        def _run():
            return self._paused_update(
                lambda: self._call_all(
                    lambda i, a: self.backend.update_distributed_call(meta, specs, meta.version),
                    timeout,
                ),
                meta.version,
            )

        return self._submit(_run)
