"""Delta weight export of ``FSDPEngine`` (``areal.api.weights_api.WeightExporter``, the
``delta`` transport of ``areal.infra.weights.transports``).

Rank 0 keeps, on the CPU, a copy of the weights the servers committed last, cast to the
servers' dtype (the *base*: its version, its dtype, the deltas committed since the last
full sync). A delta export gathers the current weights (as an HF save does, with the
verified-sync digests), casts them to that dtype and writes only the elements that
differ from the base, bit for bit (``areal.infra.weights.delta``), plus the fingerprint
reference next to them. What was exported is held as *pending*; the synchronizer's commit
(``commit_weight_delta(version)``) makes it the base, a rollback drops it: the base then
stays where the servers are, and the next sync is a full one
(``weight_delta_state()["full_next"]``). After a full sync the transport calls
``export_weight_delta(None, ...)``, which stages the whole cast copy as the pending base.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from areal.infra.weights.delta import DELTA_DIR, DeltaWriter, apply_entries, dtype_of
from areal.utils import logging

logger = logging.getLogger("FSDPEngine")

#: tensors gathered at once for a delta export
_BUCKET_BYTES = 256 << 20


class FSDPWeightDeltaMixin:
    """The committed copy and delta export of ``FSDPEngine`` (module docstring)."""

    def weight_delta_state(self) -> dict[str, Any]:
        """``{"version"`` (of the kept base, None: none yet), ``"deltas"`` (committed since
        the last full sync), ``"dtype"``, ``"full_next"`` (a delta was rolled back: the next
        sync must be full), ``"bytes"`` (of the kept copy, rank 0)``}``."""
        base = getattr(self, "_delta_base", None)
        return {
            "version": None if base is None else base["version"],
            "deltas": 0 if base is None else base["deltas"],
            "dtype": None if base is None else base["dtype"],
            "full_next": bool(getattr(self, "_delta_full_next", False)),
            "bytes": 0
            if base is None
            else sum(t.numel() * t.element_size() for t in base["tensors"].values()),
        }

    @torch.no_grad()
    def export_weight_delta(
        self, path: str | None, base_version: int | None, version: int, dtype: str
    ) -> dict[str, Any]:
        """Collective. ``path`` given: write the delta of the current weights (cast to
        ``dtype``) against the kept base, which must be ``base_version`` in ``dtype``
        (``ValueError`` otherwise), into ``path/delta/`` and the fingerprint reference
        (verified sync) into ``path``; returns the manifest on rank 0 (``{}`` elsewhere).
        ``path=None``: a full sync was sent: stage the cast weights as the next base.
        Either way the export is pending until ``commit_weight_delta(version)``."""
        from areal.infra.weights.fingerprint import REFERENCE_FILE

        dt = dtype_of(dtype)
        rank0 = dist.get_rank() == 0
        base = getattr(self, "_delta_base", None)
        full = path is None
        self._delta_pending = None
        if not full and (base is None or base["version"] != base_version or base["dtype"] != dtype):
            raise ValueError(
                f"delta export against version {base_version} in {dtype}: the kept base is "
                + ("absent" if base is None else f"version {base['version']} in {base['dtype']}")
            )
        if full:
            staged = self._gather_cast(dt) if rank0 else self._gather_cast(dt, keep=False)
            self._delta_pending = {"version": int(version), "full": True, "tensors": staged}
            self._delta_pending["dtype"] = dtype
            dist.barrier(group=self.data_parallel_group)
            return {}
        writer = digest_pool = None
        defer = False
        if rank0:
            ref = os.path.join(path, REFERENCE_FILE)
            os.makedirs(path, exist_ok=True)
            if os.path.exists(ref):  # an earlier export's
                os.remove(ref)
            writer = DeltaWriter(os.path.join(path, DELTA_DIR), int(base_version), version, dtype)
            digest_pool, defer = self._digest_plan(path)
        entries: dict[str, tuple[str, dict]] = {}
        try:
            for specs, tensors in self._gather_buckets(_BUCKET_BYTES, digest_pool, defer):
                if writer is None:
                    continue
                for spec, t in zip(specs, tensors):
                    new = t.detach().to(device="cpu", dtype=dt)
                    entries[spec.name] = writer.add(spec.name, new, base["tensors"][spec.name])
        finally:
            if digest_pool is not None:
                digest_pool.shutdown(wait=True)
        manifest: dict[str, Any] = {}
        if writer is not None:
            manifest = writer.close()
            self._write_fingerprint_reference(path)
            t = manifest["totals"]
            logger.info(
                "weight delta %d -> %d: %d of %d elements changed, %.2f MB of %.2f MB dense",
                base_version,
                version,
                t["changed"],
                t["numel"],
                t["bytes"] / 1e6,
                t["dense_bytes"] / 1e6,
            )
        self._delta_pending = {"version": int(version), "full": False, "entries": entries}
        self._delta_pending["dtype"] = dtype
        dist.barrier(group=self.data_parallel_group)
        return manifest

    def _gather_cast(self, dt: torch.dtype, keep: bool = True) -> dict[str, torch.Tensor]:
        """Every exported tensor gathered (collective), cast to ``dt`` on the CPU, as an
        own copy (never the live parameter); ``keep=False``: gathered, not kept."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self._export_tensors().items():
            t = t.detach()
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            if keep:
                out[name] = full.to(device="cpu", dtype=dt, copy=True).contiguous()
        return out

    def commit_weight_delta(self, version: int, committed: bool = True) -> dict[str, Any]:
        """The synchronizer committed ``version`` (``committed``): the pending export of that
        version becomes the kept base (a delta is applied to it, a full copy replaces it).
        ``committed=False`` (rolled back): the pending export is dropped and the base stays;
        after a rolled-back delta the next sync must be full. Returns
        ``weight_delta_state()``."""
        pending = getattr(self, "_delta_pending", None)
        self._delta_pending = None
        if not committed:
            if pending is not None and not pending["full"]:
                self._delta_full_next = True
            return self.weight_delta_state()
        if pending is None or pending["version"] != int(version):
            return self.weight_delta_state()
        base = getattr(self, "_delta_base", None)
        if pending["full"]:
            self._delta_base = {
                "version": int(version),
                "deltas": 0,
                "dtype": pending["dtype"],
                "tensors": pending["tensors"],
            }
        else:
            apply_entries(base["tensors"], pending["entries"])
            base["version"] = int(version)
            base["deltas"] += 1
        self._delta_full_next = False
        return self.weight_delta_state()
