"""Verified weight sync: ``WeightFingerprintHook`` checks every server after every push.

Disk updates (the default, ``in_response=True``): the trainer digests the tensors while it
exports them and writes its *reference* next to the weights
(``weight_fingerprint.REFERENCE_FILE``: a fresh random seed naming the check, the names
digested in full, its fingerprints; ``FSDPEngine._write_fingerprint_reference``, switched
on by ``enable_weight_fingerprints(..., reference_root=...)``). A built-in server that
loads the directory digests its live tensors right after the load and returns its
fingerprints, with that seed, in the update response
(``RemoteInfEngine.disk_update_responses``), so the check only reads the reference and
compares, tensor by tensor (``areal.infra.weights.fingerprint``): no request to the trainer
or the servers, no thread. A mismatch raises ``WeightFingerprintMismatch`` naming the
server and the tensors.

Otherwise (xccl, ``in_response=False``, a server whose answer has no fingerprint or one
for another seed, e.g. it loaded another directory) the hook asks: the trainer for the
fingerprint of what it exported (``actor.weights_fingerprint(seed)``, unless the
reference was written) and every healthy server for the fingerprint of what it now holds
(``POST /weights_fingerprint {"seed", "full"}``, a control endpoint: run secret
required).

What each check covers: a strided sample of every tensor (exact; small tensors whole) and
the row sums (every element) of a rotating ``1/full_every`` share of the tensors, so every
element of every tensor is checked once every ``full_every`` syncs (``full_every=1``: all
of them at every sync).

When: every check runs inside the sync, after the push and before the commit
(``WeightSynchronizer``: design choice (b), the commit waits for the check), so a
mismatch is a refusal: every server is rolled back to the previous weights and version
(``WeightSyncError`` or, after ``max_consecutive_refusals``, ``WeightSyncStopped`` at step
``verify``); no refused weights ever serve a token, no sample has to be dropped. The first
check also tells the trainer the dtypes the servers hold, so that later digests are taken
in those. ``background=True`` keeps the check cheap: for exports of 32 MiB or more
(``areal.engine.fsdp.fingerprints.DEFER_DIGEST_MIN_BYTES``) the trainer's file first names
only the seed and the names to digest in full (``weight_fingerprint.write_request``: what
the servers need); the trainer keeps its exported tensors and digests them on a thread of
its own while the servers load, then completes the file (``_finish_reference``); the
check waits for it (usually done by the time the servers answered). ``flush()`` has
nothing left to do (kept for callers of the earlier step-boundary mode).

Servers whose backend has no such endpoint (HTTP 404: vLLM, SGLang) are skipped with one
warning. Stats (of the sync that ran the check):
``weight_sync/fingerprint_seconds`` (of which ``..._trainer_seconds``: reading the
reference or asking the trainer; the servers' digests: ``..._server_digest_seconds``),
``weight_sync/fingerprint_tensors``, ``weight_sync/fingerprint_full_tensors``,
``weight_sync/fingerprint_servers``, ``weight_sync/fingerprint_in_response_servers``
(those whose fingerprint came with the update), ``weight_sync/fingerprint_version``.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any

from areal.infra.wait_log import fan_out
from areal.infra.weights.fingerprint import (
    REFERENCE_FILE,
    RTOL,
    Packed,
    compare_fingerprints,
    read_reference,
)
from areal.infra.weights.weight_sync import WeightSyncContext, WeightSyncHook
from areal.utils import logging
from areal.utils.auth import auth_headers, get_run_secret

logger = logging.getLogger("WeightFingerprint")

PATH = "/weights_fingerprint"


def _server_fingerprints(res: dict[str, Any]) -> dict[str, list[float]]:
    """A server's fingerprints by name from its answer: ``"fingerprints"`` (by name, as
    ``/weights_fingerprint`` answers) or ``"packed"`` (``Packed.encode``, as the disk update
    answers); ``ValueError`` when malformed."""
    if "packed" in res:
        return Packed.decode(res["packed"]).as_dict()
    got = res.get("fingerprints") or {}
    if not isinstance(got, dict):
        raise ValueError(f"fingerprints of type {type(got).__name__}, not an object")
    return got


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
    (a balanced share at each); ``background``: the trainer digests its disk exports on a
    thread while the servers load (the check, before the commit, waits for them);
    ``in_response``: disk updates
    carry the fingerprints (the trainer's written next to the weights, the servers' in
    their answers) instead of separate requests (module docstring)."""

    def __init__(
        self,
        timeout: float = 300.0,
        rtol: float = RTOL,
        full_every: int = 1,
        background: bool = False,
        in_response: bool = True,
    ):
        if not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every={full_every!r}; must be an integer >= 1")
        self.timeout = timeout
        self.rtol = rtol
        self.full_every = full_every
        self.background = bool(background)
        self._unsupported: set[str] = set()
        self._inline_passed = False  # the first check passed (dtypes resolved)
        self._configured = False  # the trainer digests its exports
        self._stats: dict[str, float] = {}
        self.in_response = bool(in_response)
        self._root: str | None = None  # where the trainer writes its references

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

        def on_answer(a: str, f: concurrent.futures.Future) -> None:
            try:
                res = f.result()
            except (requests.ConnectionError, requests.Timeout) as e:
                if exclude is None:
                    raise
                # a dead or hung server leaves the rotation (the watchdog replaces it), as
                # in RemoteInfEngine._call_all; its weights are not checked
                exclude(a, f"{PATH}: {type(e).__name__}: {e}")
                logger.warning(
                    "inference server %s did not answer %s (%s): taken out of "
                    "rotation, not verified",
                    a,
                    PATH,
                    type(e).__name__,
                )
                return
            if res is None:
                if a not in self._unsupported:
                    self._unsupported.add(a)
                    logger.warning(
                        "inference server %s has no %s endpoint: its weights are not verified",
                        a,
                        PATH,
                    )
                return
            out[a] = res

        def in_rotation(a: str) -> bool:
            return a in set(getattr(rollout, "healthy_addresses", None) or ())

        fan_out(
            lambda a: self._fetch(a, seed, full),
            addresses,
            on_answer,
            logger,
            PATH,
            answered=lambda: len(out),
            in_rotation=in_rotation if rollout is not None else None,
        )
        return out

    # ------------------------------------------------------------------ hook
    def _reference_root(self, ctx: WeightSyncContext) -> str | None:
        """Where the trainer writes its reference (disk updates with ``in_response``)."""
        meta = ctx.meta
        if not self.in_response or getattr(meta, "type", None) != "disk":
            return None
        path = getattr(meta, "path", None)
        return os.path.dirname(path) if path else None

    def _enable(self, actor: Any, dtypes: dict[str, str] | None = None) -> None:
        enable = getattr(actor, "enable_weight_fingerprints", None)
        if enable is None:
            return
        kwargs: dict[str, Any] = {}
        if self._root:
            kwargs["reference_root"] = self._root
            if self.background:  # the trainer digests its export after the sync
                kwargs["deferred"] = True
        if dtypes:
            kwargs["dtypes"] = dtypes
        enable(self.full_every, **kwargs)

    def before_push(self, ctx: WeightSyncContext) -> None:
        if not self._configured:  # the export digests what the checks compare
            self._root = self._reference_root(ctx)
            self._enable(ctx.actor)
            self._configured = True

    def verify(self, ctx: WeightSyncContext) -> None:
        """Check every server in rotation now: the synchronizer commits the version only
        after this returns (module docstring), so a mismatch leaves no refused weights
        live."""
        rollout = ctx.rollout
        addresses = list(
            getattr(rollout, "healthy_addresses", None) or getattr(rollout, "addresses", [])
        )
        version = int(ctx.version)
        path = getattr(ctx.meta, "path", None) if self._root else None
        if path and os.path.exists(os.path.join(path, REFERENCE_FILE)):
            # the trainer wrote its reference next to the weights and the servers'
            # fingerprints came with the update (no request): only a comparison is left
            answers = getattr(rollout, "disk_update_responses", None) or {}
            got = {a: (answers.get(a) or {}).get("fingerprint") for a in addresses}
            ctx.stats.update(self._answers_check(ctx.actor, rollout, path, got, version, True))
            self._inline_passed = True
            return
        seed = (version * 1_000_003 + 17) % 2**61
        ctx.stats.update(self._check(ctx.actor, rollout, addresses, version, seed, inline=True))
        self._inline_passed = True

    def _trainer_reference(self, path: str, request: dict[str, Any], version: int) -> dict:
        """The trainer's reference for a deferred ``request`` (the file in ``path`` named
        only the seed): waits until the trainer's digest thread completed the file
        (``FSDPEngine._finish_reference``, started when the save returned)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.0005
        while True:
            ref = read_reference(path)
            if ref is None or ref.get("seed") != request["seed"]:
                raise RuntimeError(
                    f"weight fingerprint reference of version {version} in {path} was "
                    f"replaced or removed before the check: it cannot be verified"
                )
            if ref.get("error"):
                raise RuntimeError(
                    f"the trainer's weight fingerprint digests of version {version} "
                    f"failed: {ref['error']}"
                )
            if not ref.get("deferred"):
                return ref
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the trainer's weight fingerprint digests of version {version} did not "
                    f"complete {path} within {self.timeout:.0f}s"
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _answers_check(
        self,
        actor: Any,
        rollout: Any,
        path: str,
        got: dict[str, Any],
        version: int,
        inline: bool = False,
    ) -> dict[str, float]:
        """Compare the fingerprints that came with the update (``got``: by address, the
        ``"fingerprint"`` of each server's answer) with the trainer's reference in ``path``
        (waited for when deferred); servers whose answer has none, or one for another
        seed (an older server, or one that loaded another directory), are asked. Returns
        stats, raises ``WeightFingerprintMismatch``."""
        t0 = time.monotonic()
        try:
            reference = read_reference(path)
        except ValueError as e:
            logger.warning("%s: asking the trainer for its fingerprint instead", e)
            reference = None
        if reference is None:  # removed meanwhile, or malformed: ask both sides
            seed = (version * 1_000_003 + 17) % 2**61
            return self._check(actor, rollout, list(got), version, seed, inline=inline)
        if reference.get("deferred"):
            reference = self._trainer_reference(path, reference, version)
        dt_read = time.monotonic() - t0
        servers, rest = {}, []
        for a, fp in got.items():
            if isinstance(fp, dict) and fp.get("seed") == reference["seed"]:
                servers[a] = fp
            else:
                rest.append(a)
        how = " (from the update answers)"
        stats = self._compare(
            actor, reference, servers, version, inline and not self._inline_passed, t0, dt_read, how
        )
        stats["weight_sync/fingerprint_in_response_servers"] = float(len(servers))
        if rest:
            seed = reference["seed"]
            stats.update(
                self._check(actor, rollout, rest, version, seed, inline=inline, reference=reference)
            )
        return stats

    def flush(self, stats: dict[str, float] | None = None) -> None:
        """A step boundary: nothing is left to check (every check ran before its commit);
        kept for callers of the earlier background mode."""
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
        reference: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """One check of every server in ``addresses`` (each asked with a request) against
        the trainer (``reference``: its written reference, else asked); returns stats,
        raises ``WeightFingerprintMismatch``."""
        t0 = time.monotonic()
        if reference is None:
            ref = actor.weights_fingerprint(seed)  # the export's digests (a small request)
            reference = {"seed": seed, "fingerprints": ref}
        else:
            seed, ref = reference["seed"], reference["fingerprints"]
        dt_trainer = time.monotonic() - t0
        full = [n for n, fp in ref.items() if len(fp) > 2]
        servers = self.server_fingerprints(addresses, seed, rollout, full)
        return self._compare(actor, reference, servers, version, inline, t0, dt_trainer)

    def _compare(
        self,
        actor: Any,
        reference: dict[str, Any],
        servers: dict[str, dict[str, Any]],
        version: int,
        inline: bool,
        t0: float,
        dt_trainer: float,
        how: str | None = None,
    ) -> dict[str, float]:
        """Compare each server's answer with the trainer's ``reference`` (``{"seed",
        "fingerprints"}``); returns stats, raises ``WeightFingerprintMismatch``. ``inline``:
        a dtype-only difference may be resolved (the first check); ``how``: for the log."""
        seed, ref = reference["seed"], reference["fingerprints"]
        full = reference.get("full")
        if full is None:
            full = [n for n, fp in ref.items() if len(fp) > 2]
        stats = {
            "weight_sync/fingerprint_trainer_seconds": dt_trainer,
            "weight_sync/fingerprint_version": float(version),
        }
        if not servers:
            return stats
        for addr, res in servers.items():
            try:
                got = _server_fingerprints(res)
                bad = compare_fingerprints(ref, got, self.rtol)
            except ValueError as e:
                got, bad = {}, [f"(the server's answer: {e})"]
            # the dtypes the server holds ("dtype": the same for every tensor)
            dtypes = (res.get("dtypes") or dict.fromkeys(ref, res.get("dtype"))) if bad else {}
            dtypes = {n: d for n, d in dtypes.items() if n in ref and isinstance(d, str)}
            if bad and dtypes and inline:
                # a server holding other dtypes (e.g. bf16): compare in its dtypes (a
                # collective recompute, only inline) and have later exports digested so
                again = actor.weights_fingerprint(seed, dtypes, full)
                bad = compare_fingerprints(again, got, self.rtol)
                if not bad:
                    self._enable(actor, dtypes)
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
            how if how is not None else "",
        )
        return stats
