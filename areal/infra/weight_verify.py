"""Verified weight sync: ``WeightFingerprintHook`` checks every server after every push.

After ``actor.update_weights(meta)`` and before any version moves (``WeightSyncHook.verify``)
the hook asks every healthy server for the fingerprint of the weights it now holds
(``POST /weights_fingerprint {"seed"}``, a control endpoint: run secret required), asks the
trainer for the fingerprint of the weights it exported, in the dtypes the server reports
(``actor.weights_fingerprint(seed, dtypes)``, ``FSDPEngine.weights_fingerprint``), and
compares them tensor by tensor (``areal.utils.weight_fingerprint``). A mismatch raises
``WeightFingerprintMismatch`` naming the server and the tensors, so the sync fails loudly
(``WeightSyncError`` at step ``verify``; versions stay where they were) instead of the
servers silently generating with stale or partial weights.

Cost: both sides take a seed-free digest of each tensor (row sums + a strided sample)
where it is touched anyway, the trainer while gathering it for the export, the built-in
server right after copying it in; at check time only the seeded projections are computed
(and the server's sample is read from its live tensors). The seed changes with every
version, so the numbers differ every time. Servers whose backend has no such endpoint
(HTTP 404: vLLM, SGLang) are skipped with one warning.
Stats: ``weight_sync/fingerprint_seconds`` (of which ``..._trainer_seconds`` and
``..._server_seconds``, concurrent; ``..._server_digest_seconds``: the digests' share of
the servers' load), ``weight_sync/fingerprint_tensors``,
``weight_sync/fingerprint_servers``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from areal.infra.wait_log import WaitLog
from areal.infra.weight_sync import WeightSyncContext, WeightSyncHook
from areal.utils import logging
from areal.utils.auth import auth_headers, get_run_secret
from areal.utils.weight_fingerprint import RTOL, compare_fingerprints

logger = logging.getLogger("WeightFingerprint")

PATH = "/weights_fingerprint"


class WeightFingerprintMismatch(RuntimeError):
    """A server's weights differ from the trainer's; ``server`` and ``tensors`` say where."""

    def __init__(self, version: int, server: str, tensors: list[str], n_checked: int):
        shown = "; ".join(tensors[:5]) + (
            f"; and {len(tensors) - 5} more" if len(tensors) > 5 else ""
        )
        super().__init__(
            f"weights of version {version} on inference server {server} differ from the "
            f"trainer's in {len(tensors)} of {n_checked} tensors: {shown}"
        )
        self.version = version
        self.server = server
        self.tensors = tensors


class WeightFingerprintHook(WeightSyncHook):
    """Compare every server's weight fingerprint with the trainer's after each push."""

    def __init__(self, timeout: float = 300.0, rtol: float = RTOL):
        self.timeout = timeout
        self.rtol = rtol
        self._unsupported: set[str] = set()

    # ------------------------------------------------------------------ servers
    def _fetch(self, addr: str, seed: int) -> dict[str, Any] | None:
        import requests

        r = requests.post(
            f"http://{addr}{PATH}",
            json={"seed": seed},
            headers=auth_headers(get_run_secret()),
            timeout=self.timeout,
        )
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RuntimeError(
                f"server {addr}: {PATH} answered HTTP {r.status_code}: {r.text[:500]}"
            )
        return r.json()

    def server_fingerprints(
        self, addresses: list[str], seed: int, rollout: Any = None
    ) -> dict[str, dict[str, Any]]:
        """``{address: {"fingerprints", "dtypes", "version"}}`` of the servers that support it.

        With ``rollout`` (the inference engine), a server that leaves its rotation while
        this waits (declared hung or dead by the health deadline, or whose connection
        fails) is not waited for any more: the watchdog replaces it and it gets the
        weights again when readmitted. Without it every server must answer.
        """
        import requests

        out: dict[str, dict[str, Any]] = {}
        if not addresses:
            return out
        exclude = getattr(rollout, "exclude_server", None)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(addresses))
        try:
            futs = {pool.submit(self._fetch, a, seed): a for a in addresses}
            pending = set(futs)
            wait_log = WaitLog(logger)
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=0.5)
                for f in done:
                    a = futs[f]
                    try:
                        res = f.result()
                    except (requests.ConnectionError, requests.Timeout) as e:
                        if exclude is None:
                            raise
                        # a dead or hung server leaves the rotation (the watchdog replaces
                        # it), as in RemoteInfEngine._call_all; its weights are not checked
                        exclude(a, f"{PATH}: {type(e).__name__}: {e}")
                        logger.warning(
                            "inference server %s did not answer %s (%s): taken out of "
                            "rotation, not verified",
                            a,
                            PATH,
                            type(e).__name__,
                        )
                        continue
                    if res is None:
                        if a not in self._unsupported:
                            self._unsupported.add(a)
                            logger.warning(
                                "inference server %s has no %s endpoint: its weights are "
                                "not verified",
                                a,
                                PATH,
                            )
                        continue
                    out[a] = res
                if rollout is not None and pending:
                    healthy = set(getattr(rollout, "healthy_addresses", None) or ())
                    for f in [f for f in pending if futs[f] not in healthy]:
                        # declared hung/dead meanwhile (health deadline): do not wait for it
                        pending.discard(f)
                        logger.warning(
                            "not waiting for %s to answer %s any more: it left the rotation",
                            futs[f],
                            PATH,
                        )
                wait_log.tick(
                    lambda pending=pending: (
                        f"{sorted(futs[f] for f in pending)} to answer {PATH} "
                        f"({len(out)} of {len(addresses)} answered)"
                    )
                )
        finally:
            pool.shutdown(wait=False)  # a hung server's thread must not hold this up
        return out

    # ------------------------------------------------------------------ hook
    def verify(self, ctx: WeightSyncContext) -> None:
        t0 = time.monotonic()
        rollout = ctx.rollout
        addresses = list(
            getattr(rollout, "healthy_addresses", None) or getattr(rollout, "addresses", [])
        )
        seed = (int(ctx.version) * 1_000_003 + 17) % 2**61

        # Trainer and servers fingerprint concurrently; the trainer uses its export dtype.
        # Only when a server holds other dtypes (e.g. bf16) and disagrees is the trainer's
        # fingerprint recomputed in the server's dtypes before a mismatch is declared.
        def _trainer() -> tuple[dict[str, list[float]], float]:
            t = time.monotonic()
            return ctx.actor.weights_fingerprint(seed, None), time.monotonic() - t

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            ref_fut = pool.submit(_trainer)
            servers = self.server_fingerprints(addresses, seed, rollout)
            ctx.stats["weight_sync/fingerprint_server_seconds"] = time.monotonic() - t0
            ref, dt_trainer = ref_fut.result()
        ctx.stats["weight_sync/fingerprint_trainer_seconds"] = dt_trainer
        if not servers:
            return
        refs: dict[tuple, dict[str, list[float]]] = {}
        for addr, res in servers.items():
            got = res.get("fingerprints") or {}
            bad = compare_fingerprints(ref, got, self.rtol)
            if bad:
                dtypes = {n: d for n, d in (res.get("dtypes") or {}).items() if n in ref}
                key = tuple(sorted(dtypes.items()))
                if key not in refs:
                    refs[key] = ctx.actor.weights_fingerprint(seed, dtypes)
                bad = compare_fingerprints(refs[key], got, self.rtol)
            if bad:
                err = WeightFingerprintMismatch(ctx.version, addr, bad, len(ref))
                logger.error("%s", err)
                raise err
        n_checked = len(ref)
        dt = time.monotonic() - t0
        ctx.stats["weight_sync/fingerprint_server_digest_seconds"] = max(
            float(res.get("digest_seconds") or 0.0) for res in servers.values()
        )
        ctx.stats["weight_sync/fingerprint_seconds"] = dt
        ctx.stats["weight_sync/fingerprint_tensors"] = float(n_checked)
        ctx.stats["weight_sync/fingerprint_servers"] = float(len(servers))
        logger.info(
            "weights of version %d verified on %d server(s) (%d tensors) in %.3fs",
            ctx.version,
            len(servers),
            n_checked,
            dt,
        )
