"""Weight fingerprint digests of ``FSDPEngine`` (verified weight sync,
``areal.infra.weights.weight_verify``): digests taken while the export has each tensor at
hand, the reference file written next to a disk weight update, deferred digests on a
thread of rank 0, and ``weights_fingerprint`` for checks that ask.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from areal.utils import logging

logger = logging.getLogger("FSDPEngine")

#: Exports at least this large digest (verified weight sync) on a thread of their own,
#: alongside the shard writes; smaller ones inline (measured on the demo model: a thread
#: adds ~1 ms to a 4 MB export, saves ~3 ms of a 116 MB one).
DIGEST_THREAD_MIN_BYTES = 32 << 20

#: Deferred digests (``enable_weight_fingerprints(deferred=True)``) hold the exported
#: tensors until a thread digested them (``_finish_reference``); exports larger than this (the
#: held tensors may be copies, e.g. cast on the GPU) are digested during the export.
DEFER_DIGEST_MAX_BYTES = 1 << 30

#: ... and so are exports smaller than this: their digests (~0.3 ms on the demo model) cost
#: less than the thread's start, hand-offs and second file write.
DEFER_DIGEST_MIN_BYTES = 32 << 20


class FSDPFingerprintMixin:
    """Fingerprint digests of the exports of ``FSDPEngine`` (module docstring)."""

    def _digest_plan(self, path: str) -> tuple[Any, bool]:
        """Rank 0, for an HF save to ``path``: (a one-thread pool the digests run on
        alongside the shard writes, or None: inline; whether they are deferred to a thread
        after the save, ``_finish_reference``)."""
        from concurrent.futures import ThreadPoolExecutor

        if not getattr(self, "_fingerprint_every", 0):
            return None, False
        if getattr(self, "_model_bytes", None) is None:  # walks the modules: once
            self._model_bytes = sum(
                p.numel() * p.element_size() for p in self._require_model().parameters()
            )
        defer = (
            getattr(self, "_fingerprint_deferred", False)
            and DEFER_DIGEST_MIN_BYTES <= self._model_bytes <= DEFER_DIGEST_MAX_BYTES
            and self._is_weight_update_path(path)
        )
        pool = None
        if self._model_bytes >= DIGEST_THREAD_MIN_BYTES and not defer:
            pool = ThreadPoolExecutor(max_workers=1)
        return pool, defer

    @torch.no_grad()
    def enable_weight_fingerprints(
        self,
        full_every: int = 1,
        dtypes: dict[str, str] | None = None,
        reference_root: str | None = None,
        deferred: bool = False,
    ) -> None:
        """Digest every later export for ``weights_fingerprint`` (verified weight sync):
        row sums of a ``1/full_every`` share of the tensors, rotating with every answered
        check (or written reference), plus a strided sample of every tensor; in
        ``dtypes[name]`` (the dtype the servers hold) when given. ``full_every=0`` turns
        the digests off. ``reference_root``: HF saves below this directory (the disk
        weight updates) also get the reference file (``_write_fingerprint_reference``).
        ``deferred``: for those weight updates the file first only names the seed and the
        names digested in full (what the servers need, ``"deferred": true``); a thread then
        digests the kept exported tensors and completes it, off the save (exports of
        ``DEFER_DIGEST_MIN_BYTES`` to ``DEFER_DIGEST_MAX_BYTES``; others are digested
        during the export)."""
        if full_every < 0:
            raise ValueError(f"full_every={full_every}; must be >= 0")
        self._fingerprint_deferred = bool(deferred)
        self._fingerprint_every = int(full_every)
        self._fingerprint_dtypes = dict(dtypes or {})
        self._fingerprint_checks = getattr(self, "_fingerprint_checks", 0)
        self._fingerprint_root = os.path.realpath(reference_root) if reference_root else None

    def _write_fingerprint_reference(self, path: str) -> None:
        """Rank 0, after an HF save under the weight-update root given to
        ``enable_weight_fingerprints``: write the export's fingerprints for a fresh random
        seed into ``path`` (``weight_fingerprint.write_reference``), for the servers that
        load it and the verifying hook; the rotation moves on to the next share."""
        from areal.infra.weights.fingerprint import FULL_SAMPLE_MAX, write_reference, write_request

        digests = getattr(self, "_export_digests", None)
        if digests is None or not digests.enabled or not self._is_weight_update_path(path):
            return  # nothing digested, or a checkpoint, not a weight update
        held = getattr(self, "_export_held", None)
        seed = int.from_bytes(os.urandom(8), "little") >> 3
        if held is not None:  # deferred: the servers' request now, the digests later
            share = digests.full
            full = [
                n for n, t in held if t.numel() > FULL_SAMPLE_MAX and (share is None or n in share)
            ]
            write_request(path, seed, sorted(full))
            self._export_held = None
            # digested on a thread while the servers load; done before the next export
            # (joined there) and before the next optimizer step (the hook's flush waits
            # for the complete reference)
            import threading

            t = threading.Thread(
                target=self._finish_reference,
                args=(path, seed, digests, held),
                name="weight-digest",
                daemon=True,
            )
            t.start()
            self._deferred_export = t
        elif digests.complete:
            write_reference(path, seed, digests)
        else:
            return
        if not digests.counted:
            digests.counted = True
            self._fingerprint_checks += 1

    def _is_weight_update_path(self, path: str) -> bool:
        """``path`` is below the weight-update root of ``enable_weight_fingerprints``."""
        root = getattr(self, "_fingerprint_root", None)
        if not root:
            return False
        if os.path.abspath(path).startswith(root + os.sep):
            return True  # (realpath costs a syscall per path component)
        real = os.path.realpath(path)
        return os.path.commonpath([real, root]) == root and real != root

    def _finish_reference(self, path: str, seed: int, digests: Any, held: list) -> None:
        """Deferred digests (a thread of rank 0, started after the weight-update save):
        digest the kept tensors and replace the request in ``path`` by the complete
        reference; on failure the file says why (``"error"``)."""
        from areal.infra.weights.fingerprint import write_error, write_reference

        try:
            with torch.no_grad():
                digests.add(held)
            digests.complete = True
            write_reference(path, seed, digests, atomic=True)  # replaces the request
        except Exception as e:  # noqa: BLE001 - reported to the verifying hook
            logger.error("weight fingerprint digests of %s failed: %s", path, e)
            write_error(path, seed, str(e))

    def _join_deferred_digests(self) -> None:
        """Wait for the deferred digests of the last weight-update export, if running."""
        t = getattr(self, "_deferred_export", None)
        if t is not None:
            t.join()
            self._deferred_export = None

    def weights_fingerprint(
        self, seed: int = 0, dtypes: dict[str, str] | None = None, full: list[str] | None = None
    ) -> dict[str, list[float]]:
        """Fingerprints (``areal.infra.weights.fingerprint``) of the exported weights by HF
        name: in full for the names in ``full`` (``None``: all), else sampled, each in the
        export dtype or in ``dtypes[name]`` (the dtype a server holds).

        Without ``dtypes`` and ``full``, after an export digested by
        ``enable_weight_fingerprints``, they come from those digests (the weights the
        servers were sent), on rank 0 (other ranks answer ``{}``), and the next export
        takes the next rotation share in full. Otherwise collective: every rank
        all-gathers each tensor; same result on every rank."""
        from areal.infra.weights.fingerprint import fingerprint_tensor

        cached = getattr(self, "_export_digests", None)
        if cached is not None and cached.complete and dtypes is None and full is None:
            if not cached.counted:  # the next export takes the next share
                cached.counted = True
                self._fingerprint_checks += 1
            return cached.fingerprints(seed)
        out: dict[str, list[float]] = {}
        for name, t in self._export_tensors().items():
            whole = t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()
            dt = (dtypes or {}).get(name)
            whole = whole.to(getattr(torch, dt) if dt else self._export_dtype())
            out[name] = fingerprint_tensor(name, whole, seed, full=full is None or name in full)
        return out
