"""Weight endpoints of the built-in server (a mixin of ``LocalInferenceServer``, which
provides ``core``, ``groups``, ``_json`` and ``_call_core``).

New weights are loaded under a *pending* version and become current only at commit
(``areal.infra.weights.weight_sync``, one owner of the version). A versioned update of
full weights (a safetensors directory, or the buckets of a broadcast) is *in flight*:
generation goes on while it loads, and no token is ever produced from pending weights:

1. ``/update_weights_from_disk`` / ``/update_weights_from_distributed`` with
   ``"version": v``: the weights are received into a staging copy
   (``weights.StagedWeights``; off the scheduler thread, so decoding continues) and
   fingerprinted there; ``/get_version`` still answers the previous version and the
   answer carries ``"pending_version": v``.
2. ``/commit_weights {"version": v}`` (or ``/set_version``, which the readmission of a
   restarted server uses): on the scheduler thread, between two decode steps, the staged
   weights are copied into the model and ``v`` becomes the version; requests running
   then go on with the new weights (their tokens from here on carry ``v``; the cache of
   their earlier tokens is kept).
3. ``/rollback_weights``: the staged weights are dropped; nothing live changed.

``/update_weights_from_delta {"model_path": dir, "version": v}`` is step 1 for a delta
(``areal.infra.weights.delta``: ``dir/delta/`` holds the changed elements since the
server's current version): staged the same way, from a copy of the live weights with the
delta applied, fingerprinted and answered as a disk update is; then commit or rollback as
above. A delta whose base version is not the server's current version, or whose dtype is
not the model's, is refused (HTTP 400) before anything is staged.

A versioned LoRA adapter (a directory with ``adapter_config.json``) is merged into the
live weights instead, after copying them aside (``weights.PendingWeights``): the client
pauses generation around it (``LocalBackend.updates_in_flight``), and a rollback copies
them back. Loads without ``"version"`` are immediate (nothing to commit).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from areal.inference.server.openai_api import error_response
from areal.inference.server.weights import PendingWeights, StagedWeights
from areal.utils import logging

logger = logging.getLogger("LocalServerWeights")

_error = error_response


class WeightRoutes:
    """Handlers of the weight and version endpoints (see module docstring)."""

    @property
    def pending(self) -> PendingWeights:
        p = self.__dict__.get("_pending_weights")
        if p is None:
            p = self._pending_weights = PendingWeights()
        return p

    @property
    def staged(self) -> StagedWeights:
        p = self.__dict__.get("_staged_weights")
        if p is None:
            p = self._staged_weights = StagedWeights()
        return p

    def _begin_pending(self, version: Any) -> None:
        """Core thread, before a load: keep the live weights (and the LoRA base weights)
        for a rollback when the load is part of a versioned update."""
        if isinstance(version, int) and not isinstance(version, bool):
            self.pending.begin(self.core.model, version, self.__dict__.get("_lora_base_weights"))

    def _state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.core.version}
        if self.staged.active:
            out["pending_version"] = self.staged.version
        elif self.pending.active:
            out["pending_version"] = self.pending.version
        return out

    def _commit_pending(self, version: int) -> bool:
        """Scheduler thread: the pending weights (staged or live) become current as
        ``version``; True when some were pending."""
        with self.staged.lock:
            staged = self.staged.commit(self.core.model) > 0
        if staged:  # new base weights: a later adapter merges into these
            self.__dict__.pop("_lora_base_weights", None)
        had = staged or self.pending.active
        self.pending.commit()
        self.core.version = version
        return had

    async def set_version(self, request):
        """``{"version": v}``: ``v`` becomes the version; pending weights become current."""
        from aiohttp import web

        body = await self._json(request)
        v = body.get("version")
        if not isinstance(v, int) or isinstance(v, bool):
            return _error(400, "'version' (int) is required")

        await self._call_core(self.core.run_command(lambda: self._commit_pending(v)))
        return web.json_response({"success": True, "version": v})

    async def commit_weights(self, request):
        """``{"version": v}``: the pending weights become current as version ``v``."""
        from aiohttp import web

        body = await self._json(request)
        v = body.get("version")
        if not isinstance(v, int) or isinstance(v, bool):
            return _error(400, "'version' (int) is required")

        had = await self._call_core(self.core.run_command(lambda: self._commit_pending(v)))
        return web.json_response({"success": True, "version": v, "had_pending": had})

    async def rollback_weights(self, request):
        """Restore the weights held before the pending update (staged ones are dropped);
        the version stays."""
        from aiohttp import web

        def _do():
            with self.staged.lock:
                if self.staged.discard():
                    return len(self.staged.targets())
            restored = self.pending.rollback(self.core.model)
            if restored is not None:
                n, lora_base = restored
                if lora_base is None:
                    self.__dict__.pop("_lora_base_weights", None)
                else:
                    self._lora_base_weights = lora_base
                return n
            return 0

        n = await self._call_core(self.core.run_command(_do))
        if n:
            logger.warning("pending weights rolled back: %d tensors restored", n)
        return web.json_response({"success": True, "restored": n, **self._state()})

    async def weights_fingerprint(self, request):
        """``{"seed": int, "full"?: [name]}`` -> fingerprints of every tensor the model
        holds (``areal.infra.weights.fingerprint``: row sums + sample for the names in
        ``full``, every tensor when it is absent; the sample only for the others), their
        dtypes, the version and ``seconds`` (the digests); computed from the live tensors
        on the core's thread, between generation steps."""
        from aiohttp import web

        body = await self._json(request)
        seed = body.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**62:
            return _error(400, "'seed' must be an integer in [0, 2**62)")
        full = body.get("full")
        if full is not None and not (
            isinstance(full, list) and all(isinstance(n, str) for n in full)
        ):
            return _error(400, "'full' must be a list of tensor names")
        full = None if full is None else set(full)
        return web.json_response(
            await self._call_core(self.core.run_command(lambda: self._fingerprint(seed, full)))
        )

    def _live_fingerprints(self) -> tuple[Any, dict[str, str]]:
        """(``LiveFingerprints`` of the tensors the server will serve: the staged ones
        while an in-flight update is pending, else the model's; their dtypes), looked up
        once per set of tensors: every loader of this server updates them in place."""
        from areal.inference.server.weights import checkpoint_tensors, tied_names
        from areal.infra.weights.fingerprint import LiveFingerprints

        model = self.core.model
        staged = self.staged.active
        source = self.staged.targets() if staged else model
        key = "_staged_fp_cache" if staged else "_live_fp_cache"
        cached = self.__dict__.get(key)
        if cached is None or cached[0] is not source:
            # by checkpoint name, as the trainer exports
            named = dict(source) if staged else checkpoint_tensors(model)
            for alias in tied_names(model):  # the same storage as another name
                named.pop(alias, None)
            dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in named.items()}
            cached = (source, LiveFingerprints(named), dtypes)
            self.__dict__[key] = cached
        return cached[1], cached[2]

    def _fingerprint(self, seed: int, full: Any) -> dict[str, Any]:
        """Fingerprints of the live weights (core thread): ``{"seed", "fingerprints",
        "dtypes", "version", "seconds"}``; ``full``: names digested in full (``None``:
        all)."""
        t0 = time.perf_counter()
        live, dtypes = self._live_fingerprints()
        return {
            "seed": seed,
            "fingerprints": live.fingerprints(seed, full=full),
            "dtypes": dtypes,
            "version": self.core.version,
            "seconds": time.perf_counter() - t0,
        }

    def _update_fingerprint(self, path: str) -> dict[str, Any] | None:
        """After a disk load (core thread): the fingerprint asked for by the trainer's
        reference in ``path`` (``weight_fingerprint.REFERENCE_FILE``: seed and names in
        full), returned with the update so that no separate request is needed:
        ``{"seed", "packed"`` (``weight_fingerprint.Packed.encode``), ``"dtype"`` (every
        tensor's) or ``"dtypes"`` (by name), ``"version", "seconds"}``; ``None`` without
        (or with an unreadable) reference: the client falls back to
        ``/weights_fingerprint``."""
        from areal.infra.weights.fingerprint import read_request

        try:
            req = read_request(path)
        except ValueError as e:
            logger.warning("%s; no fingerprint in the update response", e)
            return None
        if req is None:
            return None
        t0 = time.perf_counter()
        live, dtypes = self._live_fingerprints()
        out: dict[str, Any] = {"seed": req[0], "packed": live.packed(set(req[1])).encode()}
        kinds = set(dtypes.values())
        if len(kinds) == 1:  # one dtype for every tensor (the usual case): said once
            out["dtype"] = next(iter(kinds))
        else:
            out["dtypes"] = dtypes
        out.update(self._state())
        out["seconds"] = time.perf_counter() - t0
        return out

    async def update_weights_from_disk(self, request):

        from areal.inference.server.weights import load_weights_from_disk

        body = await self._json(request)
        path = body.get("model_path", body.get("path"))
        version = body.get("version")
        if not isinstance(path, str):
            return _error(400, "'model_path' (str) is required")
        if version is not None and not isinstance(version, int):
            return _error(400, "'version' must be an integer")
        t0 = time.monotonic()
        adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
        if version is not None and not adapter:  # in flight: staged, decoding goes on

            def _stage():
                n = self.staged.receive(
                    self.core.model,
                    version,
                    lambda into: load_weights_from_disk(self.core.model, path, into=into),
                )
                return n, self._update_fingerprint(path)

            try:
                n, fingerprint = await asyncio.get_running_loop().run_in_executor(None, _stage)
            except (FileNotFoundError, ValueError) as e:
                return _error(400, str(e))
            return self._loaded(n, fingerprint, t0)

        def _do():
            self._begin_pending(version)
            if adapter:
                # LoRA adapter only: merged into the base weights (W0 kept aside)
                from areal.models.lora_adapter import apply_adapter

                cache = self.__dict__.setdefault("_lora_base_weights", {})
                n = apply_adapter(self.core.model, path, cache)
            else:
                n = load_weights_from_disk(self.core.model, path)
                self.__dict__.pop("_lora_base_weights", None)  # new base weights
            if version is None:  # no versioned update: nothing to commit
                self.pending.commit()
            return n, self._update_fingerprint(path)

        try:
            n, fingerprint = await self._call_core(self.core.run_command(_do))
        except (FileNotFoundError, ValueError) as e:
            return _error(400, str(e))
        return self._loaded(n, fingerprint, t0)

    async def update_weights_from_delta(self, request):
        """``{"model_path": dir, "version": v}``: stage the live weights plus the delta in
        ``dir/delta/`` as pending version ``v`` (module docstring); HTTP 400 when its base
        version or dtype does not match, or another update of another version is
        pending."""
        from areal.infra.weights.delta import (
            DELTA_DIR,
            DeltaRefused,
            apply_delta,
            check_delta,
            read_manifest,
        )

        body = await self._json(request)
        path = body.get("model_path", body.get("path"))
        version = body.get("version")
        if not isinstance(path, str):
            return _error(400, "'model_path' (str) is required")
        if not isinstance(version, int) or isinstance(version, bool):
            return _error(400, "'version' (int) is required for a delta update")
        t0 = time.monotonic()
        delta_dir = os.path.join(path, DELTA_DIR)
        model = self.core.model

        def _stage():
            manifest = read_manifest(delta_dir)
            if manifest.get("version") != version:
                raise DeltaRefused(
                    f"delta in {delta_dir!r} is to version {manifest.get('version')}, the "
                    f"request says {version}"
                )
            dtype = next(model.parameters()).dtype
            with self.staged.lock:
                check_delta(manifest, self.core.version, dtype)
                if self.staged.active and self.staged.version != version:
                    raise DeltaRefused(
                        f"an update to version {self.staged.version} is pending; commit or "
                        "roll it back first"
                    )
            n = self.staged.receive(
                model, version, lambda into: apply_delta(delta_dir, into, manifest)
            )
            return n, self._update_fingerprint(path), manifest["totals"]

        try:
            n, fingerprint, totals = await asyncio.get_running_loop().run_in_executor(None, _stage)
        except (FileNotFoundError, ValueError) as e:  # DeltaRefused is a ValueError
            logger.warning("delta update to version %s refused: %s", version, e)
            return _error(400, str(e))
        logger.info(
            "delta to version %d staged: %d tensors, %d elements changed (%d bytes)",
            version,
            n,
            totals.get("changed", 0),
            totals.get("bytes", 0),
        )
        return self._loaded(n, fingerprint, t0)

    def _loaded(self, n: int, fingerprint: dict[str, Any] | None, t0: float):
        from aiohttp import web

        out = {
            "success": True,
            "num_tensors": n,
            **self._state(),
            "time_s": time.monotonic() - t0,
        }
        if fingerprint is not None:  # verified weight sync (areal.infra.weight_verify)
            out["fingerprint"] = fingerprint
        return web.json_response(out)

    async def init_weights_update_group(self, request):
        from aiohttp import web

        from areal.inference.server.weights import init_custom_process_group

        body = await self._json(request)
        try:
            host = str(body["master_address"])
            port = int(body["master_port"])
            world_size = int(body["world_size"])
            rank = int(body.get("rank", body.get("rank_offset", 1)))
            group_name = str(body.get("group_name", "areal_weight_update"))
            backend = str(body.get("backend", "gloo"))
            timeout_s = float(body.get("timeout_s", 120.0))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            return _error(400, f"bad init_weights_update_group request: {e!r}")
        if not 0 < rank < world_size:
            return _error(400, f"rank={rank} must be in [1, world_size={world_size})")
        checks = [
            (0 < port < 65536, f"master_port={port} outside [1, 65535]"),
            (world_size <= 65536, f"world_size={world_size} above 65536"),
            (0 < timeout_s <= 3600, f"timeout_s={timeout_s}; must be in (0, 3600]"),
            (
                backend == "gloo" or (backend == "nccl" and self.core.device.type == "cuda"),
                f"backend={backend!r}; allowed: 'gloo', 'nccl' (CUDA servers)",
            ),
        ]
        bad = next((msg for ok, msg in checks if not ok), None)
        if bad:
            return _error(400, bad)
        loop = asyncio.get_running_loop()
        try:
            pg = await loop.run_in_executor(
                None,
                lambda: init_custom_process_group(
                    backend, host, port, world_size, rank, group_name, timeout_s
                ),
            )
        except ValueError as e:
            return _error(400, str(e))
        except Exception as e:
            return _error(500, f"joining group {group_name!r} failed: {e}")
        self.groups[group_name] = pg
        return web.json_response({"success": True, "rank": rank, "group_name": group_name})

    async def update_weights_from_distributed(self, request):
        from aiohttp import web

        from areal.api.io_struct import ParamSpec
        from areal.inference.server.weights import receive_bucket

        body = await self._json(request)
        group_name = body.get("group_name", "areal_weight_update")
        if not isinstance(group_name, str):
            return _error(400, "'group_name' must be a string")
        pg = self.groups.get(group_name)
        if pg is None:
            return _error(
                400, f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        try:
            if "param_specs" in body:
                specs = [ParamSpec.from_dict(d) for d in body["param_specs"]]
            else:
                specs = [
                    ParamSpec(n, tuple(s), d)
                    for n, s, d in zip(body["names"], body["shapes"], body["dtypes"], strict=True)
                ]
            for s in specs:
                if not isinstance(s.name, str):
                    raise TypeError(f"{s.name!r} is not a name")
                import torch

                if not isinstance(getattr(torch, s.dtype, None), torch.dtype):
                    raise ValueError(f"unknown dtype {s.dtype!r}")
        except (KeyError, TypeError, ValueError) as e:
            return _error(400, f"bad update_weights_from_distributed request: {e!r}")
        version = body.get("version")
        t0 = time.monotonic()

        def _do():
            self._begin_pending(version)
            return receive_bucket(self.core.model, pg, specs)

        def _stage():  # a versioned update is in flight: staged, decoding goes on
            return self.staged.receive(
                self.core.model,
                version,
                lambda into: receive_bucket(self.core.model, pg, specs, into=into),
            )

        try:
            if isinstance(version, int) and not isinstance(version, bool):
                n = await asyncio.get_running_loop().run_in_executor(None, _stage)
            else:
                n = await self._call_core(self.core.run_command(_do))
        except ValueError as e:
            return _error(400, str(e))
        return web.json_response(
            {
                "success": True,
                "num_tensors": n,
                **self._state(),
                "time_s": time.monotonic() - t0,
            }
        )
