"""Weight-update RPCs of ``RemoteInfEngine``: load under a pending version (from disk, or
one announced bucket of an ``xccl`` broadcast, or a weight delta), join the ``xccl`` group, commit the
pending version, roll the servers back.

None of them pauses generation or moves a version on its own: pausing and versions
belong to ``areal.infra.weights.weight_sync.WeightSynchronizer``, which calls, in order,
``pause_generation``, ``update_weights_from_disk`` / ``update_weights_from_distributed``
(servers hold the new weights as *pending*), its checks, then ``commit_weights(version)``
or ``rollback_weights(previous_path)``, then ``continue_generation``. The load calls
return ``concurrent.futures.Future`` (run on the engine's thread pool); commit and
rollback block.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.infra.daemon_threads import spawn_daemon
from areal.utils import logging

logger = logging.getLogger("RemoteInfEngine")


class WeightUpdateRPCMixin:
    """Weight updates of ``RemoteInfEngine`` (module docstring).

    Uses the engine's ``config``, ``backend``, ``_executor`` (thread pool), ``_version``,
    ``disk_update_responses``, ``healthy_addresses``, ``_mark_unhealthy`` and
    ``_post``/``_post_idempotent``/``_call_all`` (``areal.inference.remote.http``).
    """

    def _submit(self, fn: Callable[[], Any]) -> Future:
        if self._executor is None:
            raise RuntimeError("RemoteInfEngine.initialize() was not called")
        return self._executor.submit(fn)

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        """Every server in rotation loads ``meta.path`` as pending ``meta.version``."""
        if meta.type != "disk" or not meta.path:
            raise ValueError(
                "update_weights_from_disk needs a WeightUpdateMeta of type 'disk' with a path"
            )

        def call():
            return self.backend.update_disk_call(meta.path, meta.version)

        return self._submit(lambda: self._load_on_all(call, meta, "weights loaded from"))

    def _load_on_all(self, call: Callable[[], Any], meta: WeightUpdateMeta, what: str) -> None:
        """Every server in rotation answers ``call()`` (a disk load or a delta, pending
        ``meta.version``); each server's answer, e.g. its weight fingerprint
        (areal.infra.weights), is kept in ``disk_update_responses``."""
        t0 = time.monotonic()
        self.disk_update_responses = responses = {}
        self._call_all(lambda i, a: call(), idempotent=True, responses=responses)
        logger.info(
            "%s %s (pending version %s) in %.2fs",
            what,
            meta.path,
            meta.version,
            time.monotonic() - t0,
        )

    def supports_weight_delta(self) -> bool:
        """Whether this backend's servers apply weight deltas (``update_weights_from_delta``;
        the built-in server does, vLLM/SGLang do not)."""
        return self.backend.update_delta_call("", 0) is not None

    def update_weights_from_delta(self, meta: WeightUpdateMeta) -> Future:
        """Every server in rotation applies the delta written under ``meta.path``
        (``areal.infra.weights.delta``) as pending ``meta.version``; a server whose current
        version is not the delta's base answers HTTP 400 (the push fails)."""
        if meta.type != "disk" or not meta.path or meta.version is None:
            raise ValueError(
                "update_weights_from_delta needs a WeightUpdateMeta of type 'disk' with a path "
                "and a version"
            )
        if not self.supports_weight_delta():
            raise ValueError(f"backend {self.backend.name!r} has no weight delta route")

        def call():
            return self.backend.update_delta_call(meta.path, meta.version)

        return self._submit(lambda: self._load_on_all(call, meta, "weight delta applied from"))

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
            futs = [
                spawn_daemon(
                    self._post,
                    a,
                    self.backend.init_group_call(meta, 1 + i, world_size),
                    timeout,
                    name=f"init weight group {a}",
                )
                for i, a in enumerate(addrs)
            ]
            return [f.result() for f in futs]

        return self._submit(_run)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> Future:
        """Announce one bucket; the Future completes when every server has received it
        (as pending ``meta.version``)."""
        specs = list(param_specs)
        timeout = self._weight_update_http_timeout(meta)

        def _run():
            return self._call_all(
                lambda i, a: self.backend.update_distributed_call(meta, specs, meta.version),
                timeout,
            )

        return self._submit(_run)

    def _each_server(self, make_call: Callable[[str], Any], what: str) -> list[str]:
        """Send ``make_call(addr)`` (an ``HttpCall``) to every server in rotation at once;
        a server that fails is taken out of rotation (the ``ServerWatchdog`` readmits it
        with the current weights). Returns the servers that failed."""
        addrs = self.healthy_addresses
        failed: list[str] = []
        if not addrs:
            return failed
        futs = {
            spawn_daemon(self._post_idempotent, a, make_call(a), name=f"{what} {a}"): a
            for a in addrs
        }
        for f in concurrent.futures.as_completed(futs):
            a = futs[f]
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - that server leaves the rotation
                failed.append(a)
                self._mark_unhealthy(a, f"{what} failed: {type(e).__name__}: {e}")
        return failed

    def commit_weights(self, version: int) -> list[str]:
        """The pending weights become current as ``version`` on every server in rotation
        (built-in: ``/commit_weights``; vLLM/SGLang: the version call, if any), then on
        this client. Returns the servers that failed (out of rotation)."""
        version = int(version)
        failed: list[str] = []
        if self.backend.commit_call(version) is not None:
            failed = self._each_server(
                lambda a: self.backend.commit_call(version), f"commit of version {version}"
            )
        self._version = version
        return failed

    def rollback_weights(self, previous_path: str | None) -> list[str]:
        """Every server in rotation serves the weights it had before the pending update
        again (built-in: ``/rollback_weights`` restores its copy; vLLM/SGLang reload
        ``previous_path``); the version stays. A server that cannot be rolled back (no
        path for a backend without a copy, or an error) is taken out of rotation. Returns
        those servers."""
        call = self.backend.rollback_call(previous_path)
        if call is None:
            addrs = self.healthy_addresses
            for a in addrs:
                self._mark_unhealthy(a, "no previous weights to roll back to")
            return addrs
        t0 = time.monotonic()
        failed = self._each_server(lambda a: call, "weight rollback")
        logger.warning(
            "servers rolled back to version %d in %.2fs%s",
            self._version,
            time.monotonic() - t0,
            f" ({failed} out of rotation)" if failed else "",
        )
        return failed
