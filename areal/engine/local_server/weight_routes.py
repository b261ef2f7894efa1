"""Weight endpoints of the built-in server (a mixin of ``LocalInferenceServer``, which
provides ``core``, ``groups``, ``_json`` and ``_call_core``).

New weights are loaded under a *pending* version and become current only at commit
(``areal.infra.weights.weight_sync``, one owner of the version):

1. ``/update_weights_from_disk`` / ``/update_weights_from_distributed`` with
   ``"version": v``: the first load of a round copies the live weights aside
   (``weights.PendingWeights``), then loads the new ones; ``/get_version`` still answers
   the previous version and the answer carries ``"pending_version": v``.
2. ``/commit_weights {"version": v}`` (or ``/set_version``, which the readmission of a
   restarted server uses): ``v`` becomes the version, the copy is dropped.
3. ``/rollback_weights``: the copy is restored (the weights served before step 1), the
   version stays the previous one, the pending version is dropped.

Loads without ``"version"`` are immediate, as before (nothing to commit). Generation is
paused by the client around all of this, so no token is produced from pending weights.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from areal.engine.local_server.openai_api import error_response
from areal.engine.local_server.weights import PendingWeights
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

    def _begin_pending(self, version: Any) -> None:
        """Core thread, before a load: keep the live weights (and the LoRA base weights)
        for a rollback when the load is part of a versioned update."""
        if isinstance(version, int) and not isinstance(version, bool):
            self.pending.begin(self.core.model, version, self.__dict__.get("_lora_base_weights"))

    def _state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.core.version}
        if self.pending.active:
            out["pending_version"] = self.pending.version
        return out

    async def set_version(self, request):
        """``{"version": v}``: ``v`` becomes the version; pending weights become current."""
        from aiohttp import web

        body = await self._json(request)
        v = body.get("version")
        if not isinstance(v, int) or isinstance(v, bool):
            return _error(400, "'version' (int) is required")

        def _do():
            self.pending.commit()
            self.core.version = v

        await self._call_core(self.core.run_command(_do))
        return web.json_response({"success": True, "version": v})

    async def commit_weights(self, request):
        """``{"version": v}``: the pending weights become current as version ``v``."""
        from aiohttp import web

        body = await self._json(request)
        v = body.get("version")
        if not isinstance(v, int) or isinstance(v, bool):
            return _error(400, "'version' (int) is required")

        def _do():
            had = self.pending.active
            self.pending.commit()
            self.core.version = v
            return had

        had = await self._call_core(self.core.run_command(_do))
        return web.json_response({"success": True, "version": v, "had_pending": had})

    async def rollback_weights(self, request):
        """Restore the weights held before the pending update; the version stays."""
        from aiohttp import web

        def _do():
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
        holds (``areal.utils.weight_fingerprint``: row sums + sample for the names in
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
        """(``LiveFingerprints`` of the model's tensors, their dtypes), looked up once per
        model: every loader of this server updates the tensors in place (copy_)."""
        from areal.engine.local_server.weights import checkpoint_tensors, tied_names
        from areal.utils.weight_fingerprint import LiveFingerprints

        model = self.core.model
        cached = self.__dict__.get("_live_fp_cache")
        if cached is None or cached[0] is not model:
            named = checkpoint_tensors(model)  # by checkpoint name, as the trainer exports
            for alias in tied_names(model):  # the same storage as another name
                named.pop(alias, None)
            dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in named.items()}
            cached = self._live_fp_cache = (model, LiveFingerprints(named), dtypes)
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
        from areal.utils.weight_fingerprint import read_request

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
        from aiohttp import web

        from areal.engine.local_server.weights import load_weights_from_disk

        body = await self._json(request)
        path = body.get("model_path", body.get("path"))
        version = body.get("version")
        if not isinstance(path, str):
            return _error(400, "'model_path' (str) is required")
        if version is not None and not isinstance(version, int):
            return _error(400, "'version' must be an integer")
        t0 = time.monotonic()

        def _do():
            self._begin_pending(version)
            if os.path.isfile(os.path.join(path, "adapter_config.json")):
                # LoRA adapter only: merged into the base weights (W0 kept aside)
                from areal.engine.lora import apply_adapter

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

        from areal.engine.local_server.weights import init_custom_process_group

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
        from areal.engine.local_server.weights import receive_bucket

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

        try:
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
