"""Verified weight sync: ``WeightFingerprintHook`` checks every server after every push.

After ``actor.update_weights(meta)`` (``WeightSyncHook.verify``) the hook asks the trainer
for the fingerprint of the weights it exported (``actor.weights_fingerprint(seed)``,
``FSDPEngine.weights_fingerprint``: from digests taken during the export) and every
healthy server for the fingerprint of the weights it now holds (``POST
/weights_fingerprint {"seed", "full"}``, a control endpoint: run secret required), and
compares them tensor by tensor (``areal.utils.weight_fingerprint``). A mismatch raises
``WeightFingerprintMismatch`` naming the server and the tensors.

What each check covers: a strided sample of every tensor (exact; small tensors whole) and
the row sums (every element) of a rotating ``1/full_every`` share of the tensors, so every
element of every tensor is checked once every ``full_every`` syncs (``full_every=1``: all
of them at every sync). The seed changes with every version.

When: the first check runs inside the sync, before any version moves (``WeightSyncError``
at step ``verify``); it also tells the trainer the dtypes the servers hold, so that later
digests are taken in those. With ``background=True`` every later check runs on a thread
of the hook while rollout and training go on, and a mismatch it finds is logged at once
and raised at the next step boundary: ``flush()`` (``WeightSynchronizer.flush``, called by
the trainer before each step and after the last one) or the next sync's ``before_push``,
whichever comes first (``WeightSyncError`` at step ``before_push``). The weights of one
version may thus serve one step before the run stops. ``background=False``: every check
runs inside its sync.

Servers whose backend has no such endpoint (HTTP 404: vLLM, SGLang) are skipped with one
warning. Stats (of the sync that ran the check; a background check's in the next sync):
``weight_sync/fingerprint_seconds`` (of which ``..._trainer_seconds``; the servers'
digests: ``..._server_digest_seconds``), ``weight_sync/fingerprint_tensors``,
``weight_sync/fingerprint_full_tensors``, ``weight_sync/fingerprint_servers``,
``weight_sync/fingerprint_version``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from areal.infra.rpc.client import spawn_daemon
from areal.infra.wait_log import WaitLog, waiting
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
    """Compare every server's weight fingerprint with the trainer's after each push.

    ``full_every``: the row sums of every tensor are checked once every this many syncs
    (a balanced share at each); ``background``: checks after the first one run on a
    thread and a mismatch fails the next step boundary (module docstring)."""

    def __init__(
        self,
        timeout: float = 300.0,
        rtol: float = RTOL,
        full_every: int = 1,
        background: bool = False,
    ):
        if not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every={full_every!r}; must be an integer >= 1")
        self.timeout = timeout
        self.rtol = rtol
        self.full_every = full_every
        self.background = bool(background)
        self._unsupported: set[str] = set()
        self._inline_passed = False  # later checks may run in the background
        self._configured = False  # the trainer digests its exports
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self._due: tuple | None = None  # a background check to start after the sync
        self._stats: dict[str, float] = {}  # of a background check, not yet reported

    # ------------------------------------------------------------------ servers
    def _fetch(self, addr: str, seed: int, full: list[str] | None) -> dict[str, Any] | None:
        import requests

        body: dict[str, Any] = {"seed": seed}
        if full is not None:
            body["full"] = full

        def post():
            return requests.post(
                f"http://{addr}{PATH}",
                json=body,
                headers=auth_headers(get_run_secret()),
                timeout=self.timeout,
            )

        try:
            r = post()
        except requests.ConnectionError as e:
            # A read-only call: a dropped connection to a server that still answers its
            # health probe is retried once (as the idempotent control calls are) instead of
            # taking the server out of the rotation.
            try:
                requests.get(f"http://{addr}/health", timeout=5.0).raise_for_status()
            except Exception:  # noqa: BLE001 - no answer: the original error stands
                raise e from None
            logger.warning("%s %s: connection dropped (%s); retrying once", addr, PATH, e)
            r = post()
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RuntimeError(
                f"server {addr}: {PATH} answered HTTP {r.status_code}: {r.text[:500]}"
            )
        return r.json()

    def server_fingerprints(
        self,
        addresses: list[str],
        seed: int,
        rollout: Any = None,
        full: list[str] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """``{address: {"fingerprints", "dtypes", "version", "seconds"}}`` of the servers
        that support it; ``full``: the names to digest in full (``None``: all).

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
            futs = {pool.submit(self._fetch, a, seed, full): a for a in addresses}
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
    def before_push(self, ctx: WeightSyncContext) -> None:
        self.flush(ctx.stats)  # a mismatch found in the background fails this sync
        if not self._configured:
            enable = getattr(ctx.actor, "enable_weight_fingerprints", None)
            if enable is not None:  # the export digests what the checks compare
                enable(self.full_every)
            self._configured = True

    def verify(self, ctx: WeightSyncContext) -> None:
        rollout = ctx.rollout
        addresses = list(
            getattr(rollout, "healthy_addresses", None) or getattr(rollout, "addresses", [])
        )
        version = int(ctx.version)
        check = (ctx.actor, rollout, addresses, version, (version * 1_000_003 + 17) % 2**61)
        if self.background and self._inline_passed:
            self._due = check  # started by after_sync: off the sync's own requests
            return
        ctx.stats.update(self._check(*check, inline=True))
        self._inline_passed = True

    def after_sync(self, ctx: WeightSyncContext) -> None:
        if self._due is None:
            return
        check, self._due = self._due, None
        # a daemon thread: a check waiting on a hung server never blocks the exit
        self._pending = (check[3], spawn_daemon(self._check, *check, name="weight-fingerprint"))

    def on_error(self, ctx: WeightSyncContext, error: BaseException) -> None:
        self._due = None  # the sync failed before its versions moved: nothing to check

    def flush(self, stats: dict[str, float] | None = None) -> None:
        """Wait for the background check still running, if any, and raise what it found
        (``WeightFingerprintMismatch``). Its stats go into ``stats`` (else into those of
        the next sync)."""
        if self._pending is not None:
            version, fut = self._pending
            self._pending = None
            if not fut.done():
                with waiting(logger, f"the fingerprint check of weights version {version}"):
                    concurrent.futures.wait([fut])
            self._stats.update(fut.result())  # raises the mismatch
        if stats is not None:
            stats.update(self._stats)
            self._stats = {}

    def _check(
        self,
        actor: Any,
        rollout: Any,
        addresses: list[str],
        version: int,
        seed: int,
        inline: bool = False,
    ) -> dict[str, float]:
        """One check of every server in ``addresses`` against the trainer; returns stats,
        raises ``WeightFingerprintMismatch``."""
        t0 = time.monotonic()
        ref = actor.weights_fingerprint(seed)  # the export's digests (a small request)
        dt_trainer = time.monotonic() - t0
        full = [n for n, fp in ref.items() if len(fp) > 2]
        servers = self.server_fingerprints(addresses, seed, rollout, full)
        stats = {
            "weight_sync/fingerprint_trainer_seconds": dt_trainer,
            "weight_sync/fingerprint_version": float(version),
        }
        if not servers:
            return stats
        for addr, res in servers.items():
            got = res.get("fingerprints") or {}
            bad = compare_fingerprints(ref, got, self.rtol)
            dtypes = {n: d for n, d in (res.get("dtypes") or {}).items() if n in ref}
            if bad and dtypes and inline:
                # a server holding other dtypes (e.g. bf16): compare in its dtypes (a
                # collective recompute, only inline) and have later exports digested so
                again = actor.weights_fingerprint(seed, dtypes, full)
                bad = compare_fingerprints(again, got, self.rtol)
                if not bad and getattr(actor, "enable_weight_fingerprints", None) is not None:
                    actor.enable_weight_fingerprints(self.full_every, dtypes)
            if bad:
                err = WeightFingerprintMismatch(version, addr, bad, len(ref))
                logger.error("%s", err)
                raise err
        dt = time.monotonic() - t0
        stats.update(
            {
                "weight_sync/fingerprint_seconds": dt,
                "weight_sync/fingerprint_server_digest_seconds": max(
                    float(res.get("seconds") or 0.0) for res in servers.values()
                ),
                "weight_sync/fingerprint_tensors": float(len(ref)),
                "weight_sync/fingerprint_full_tensors": float(len(full)),
                "weight_sync/fingerprint_servers": float(len(servers)),
            }
        )
        logger.info(
            "weights of version %d verified on %d server(s) (%d tensors, %d in full) in %.3fs%s",
            version,
            len(servers),
            len(ref),
            len(full),
            dt,
            "" if inline else " (background)",
        )
        return stats
