"""``WeightSynchronizer``: the one place where trained weights reach the inference servers.

It alone pauses generation, drives the transport, verifies, and commits versions (on the
actor, the critic, the rollout client and every server); transports
(``areal.infra.weights.transports``: disk, adapter-only, sharded, xccl) only move weights
and never pause or set a version. One ``sync(version)`` runs, in this order::

    pause        rollout.pause()               no new episodes start (WorkflowExecutor)
                 rollout.pause_generation()    in-flight requests are interrupted (they
                                               resume later, on the weights then current),
                                               unless rollout.updates_in_flight(meta): the
                                               built-in server takes full weights beside
                                               the live ones while it generates
    regroup      xccl: re-form the weight-update group when the servers changed
    hooks        hook.before_push(ctx)
                 ctx.meta = hook.transform(ctx, ctx.meta)   what to send (e.g. LoRA adapter;
                                               one that cannot go in flight pauses here)
    export       transport.export(ctx)         the trainer writes / stages the weights
    push         transport.push(ctx)           every server loads them as the *pending*
                                               version; /get_version still answers the old
    verify       hook.verify(ctx)              raise to refuse the new weights; the commit
                                               waits for every check (none runs after it)
    commit       transport.commit(ctx)         every server: pending -> current ``version``
                                               (in flight: between two decode steps)
                 actor / critic / rollout get ``version``; disk: older versions'
                 directories are deleted
    hooks        hook.after_push(ctx)
    resume       rollout.continue_generation() interrupted requests continue (if paused)
                 rollout.resume()              only when ``resume=True``; the trainer keeps
                                               it paused until its recover checkpoint is
                                               written and calls ``resume()`` itself
    hooks        hook.after_sync(ctx)

A refusal (``export``, ``push`` or ``verify`` failed: a fingerprint mismatch, one server of
several answering an error, a failed save) never leaves a refused version live: every
server is rolled back (``transport.rollback``: the built-in server restores the copy it
kept of its previous weights; vLLM/SGLang reload the previous version's directory), a
server that cannot be rolled back is taken out of rotation (the ``ServerWatchdog``
readmits it with the current weights), generation resumes on the previous weights at the
previous version, the rollout's staleness bound counts the step's consumed batch as a
version (``StalenessManager.on_sync_refused``: with ``max_head_offpolicyness = 0`` the
next step's batch could otherwise never start), every hook's ``on_error`` runs, and then,
as configured
(``max_consecutive_refusals``, the trainer's
``rollout.max_consecutive_weight_sync_refusals``): the sync returns with
``weight_sync/refused = 1`` and the run continues on the old version (the next step
retries), or, after that many refusals in a row, ``WeightSyncStopped`` names the version,
the server and the tensor. ``0`` stops at the first refusal, ``None`` never stops.
Counted in ``weight_sync/refusals`` / ``weight_sync/consecutive_refusals`` (the stats
of the sync, and ``stats_tracker``). A failure at another step (pause, the hooks) raises
``WeightSyncError`` after generation was resumed; versions do not move.

Verification's timing (choice (b) of the design): the commit waits for the check. With
``WeightFingerprintHook(background=True)`` the trainer still digests its export on a
thread while the servers load (``areal.infra.weights.weight_verify``), so waiting costs
little; no check ever finishes after the sync returned, so no refused weights serve a
single token and no sample has to be dropped.

``readmit(address)`` brings a restarted server back with the current weights
(``ServerWatchdog``): the weights of the current version from the weight-update
directory (disk mode), else written once per version to ``scratch_dir``. After a refusal
the actor holds the refused weights, so a version with no copy on disk cannot be
readmitted from it: ``readmit`` raises (the watchdog counts a failed restart and keeps
the server out of rotation) until the next sync commits. ``sync`` and
``readmit`` hold one lock, so a server readmitted from a background thread can never
miss a version: it is readmitted either before a sync (and gets it) or after (and loads
the new weights).

``xccl``: the weight-update process group is formed once with the servers in rotation at
that time. When the set of servers in rotation changes (one died, hung or was
restarted), ``sync`` re-forms the group before the broadcast, with the servers in
rotation now: a fresh rendezvous port and group name (``{group_name}-r{n}``), joined by
training rank 0 (``actor.connect_engine``) and by every server
(``init_weights_update_group``). A restarted server thereby rejoins the broadcast group;
a dead one no longer stalls the broadcast. Counted in ``weight_sync/group_reforms``.

Extension point: ``WeightSyncHook`` (subclass it, override what you need, pass it in
``hooks=`` or ``add_hook``). Hooks run in registration order.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Iterable
from typing import Any

from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal.infra.wait_log import waiting
from areal.infra.weights.transports import WeightTransport, transport_for
from areal.utils import logging, stats_tracker

logger = logging.getLogger("WeightSynchronizer")


def _answers_health(rollout: Any, addr: str, timeout: float = 5.0) -> bool:
    import requests

    path = getattr(getattr(rollout, "backend", None), "health_path", "/health")
    try:
        return requests.get(f"http://{addr}{path}", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


#: Steps whose failure is a refusal: the servers are rolled back (module docstring).
REFUSAL_STEPS = ("export", "push", "verify")


class WeightSyncError(RuntimeError):
    """A weight sync failed; ``step`` is where ("pause", "before_push", "push", ...)."""

    def __init__(self, version: int, step: str, cause: BaseException, note: str = ""):
        moved = step in ("after_push", "resume")
        super().__init__(
            f"weight sync to version {version} failed at {step!r}: {type(cause).__name__}: "
            f"{cause}. Generation was resumed; "
            + ("the new weights and versions are in place." if moved else "versions unchanged.")
            + (f" {note}" if note else "")
        )
        self.version = version
        self.step = step


def _where(cause: BaseException) -> tuple[str, str]:
    """(server, tensor) a refusal names: a fingerprint mismatch says both, an HTTP error
    its server; "unknown" otherwise."""
    server = getattr(cause, "server", None) or getattr(cause, "address", None) or "unknown"
    tensors = getattr(cause, "tensors", None) or []
    # a mismatch lists "name (what differs)": the name alone
    return str(server), (str(tensors[0]).split(" (")[0] if tensors else "unknown")


class WeightSyncStopped(WeightSyncError):
    """``max_consecutive_refusals`` refusals in a row: the run stops. Names the version,
    the server and the tensor of the last refusal (``server`` / ``tensor``)."""

    def __init__(self, version: int, step: str, cause: BaseException, refusals: int):
        self.server, self.tensor = _where(cause)
        super().__init__(
            version,
            step,
            cause,
            f"Stopping after {refusals} consecutive refused weight sync(s): version {version}, "
            f"server {self.server}, tensor {self.tensor}; every server serves the previous "
            f"weights.",
        )
        self.refusals = refusals


@dataclasses.dataclass
class WeightSyncContext:
    """What one sync is about; hooks may read everything and write ``meta`` / ``stats``."""

    version: int  # the version the servers get
    previous_version: int  # the version they had
    meta: WeightUpdateMeta  # what is pushed (``transform`` may replace it)
    reason: str  # "step" | "recover" | caller-defined
    actor: Any
    rollout: Any
    critic: Any = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


class WeightSyncHook:
    """Extension point of ``WeightSynchronizer.sync`` (all methods optional; no-ops here).

    - ``before_push(ctx)``: servers paused, nothing sent yet.
    - ``transform(ctx, meta) -> meta``: what to send, e.g. an adapter-only update for LoRA
      or an extra vision-tower path; return ``meta`` unchanged when not concerned.
    - ``verify(ctx)``: after the push, before any version moves; raise to refuse the
      weights (e.g. a fingerprint that does not match the trainer's).
    - ``after_push(ctx)``: versions set everywhere, servers still paused.
    - ``on_error(ctx, error)``: the sync failed (servers already resumed); must not raise.
    - ``after_sync(ctx)``: the sync succeeded and generation resumed (e.g. start
      background work that must not compete with the sync); must not raise.
    - ``flush()``: at a step boundary (``WeightSynchronizer.flush``): wait for work the
      hook left running after a sync (e.g. a background check) and raise what it found.
    """

    def before_push(self, ctx: WeightSyncContext) -> None:
        pass

    def transform(self, ctx: WeightSyncContext, meta: WeightUpdateMeta) -> WeightUpdateMeta:
        return meta

    def verify(self, ctx: WeightSyncContext) -> None:
        pass

    def after_push(self, ctx: WeightSyncContext) -> None:
        pass

    def on_error(self, ctx: WeightSyncContext, error: BaseException) -> None:
        pass

    def after_sync(self, ctx: WeightSyncContext) -> None:
        pass

    def flush(self) -> None:
        pass


class WeightSynchronizer:
    """Pause -> export -> push -> verify -> commit everywhere -> resume (module docstring).

    ``actor``: the train controller (``update_weights(meta)``, ``set_version``, ``save``),
    already ``connect_engine``-ed to ``rollout``. ``rollout``: the inference engine
    (``RemoteInfEngine``: ``pause``/``resume`` of its executor,
    ``pause_generation``/``continue_generation``, ``set_version``/``get_version``,
    ``readmit_server``, ``commit_weights``, ``rollback_weights``). ``critic``: gets the
    version too. ``scratch_dir``: where ``readmit`` writes the current weights when no
    weight-update directory has them. ``max_consecutive_refusals``: refusals in a row
    after which ``sync`` raises ``WeightSyncStopped`` (0: the first; None: never); below
    it a refused sync returns with ``weight_sync/refused = 1`` (module docstring).
    ``initial_weights_path``: the model the servers started from, reloaded by servers that
    cannot restore their own copy (vLLM, SGLang) when a sync from version 0 is refused.
    """

    def __init__(
        self,
        actor: Any,
        rollout: Any,
        meta: WeightUpdateMeta | None,
        critic: Any = None,
        hooks: Iterable[WeightSyncHook] = (),
        scratch_dir: str | None = None,
        max_consecutive_refusals: int | None = 0,
        initial_weights_path: str | None = None,
    ):
        if max_consecutive_refusals is not None and (
            not isinstance(max_consecutive_refusals, int) or max_consecutive_refusals < 0
        ):
            raise ValueError(
                f"max_consecutive_refusals={max_consecutive_refusals!r}; must be None or an "
                "integer >= 0"
            )
        self.max_consecutive_refusals = max_consecutive_refusals
        self.initial_weights_path = initial_weights_path
        self.consecutive_refusals = 0
        self.total_refusals = 0
        self.last_refusal: WeightSyncError | None = None
        self.actor = actor
        self.rollout = rollout
        self.meta = meta
        self.critic = critic
        self.hooks: list[WeightSyncHook] = list(hooks)
        self.scratch_dir = scratch_dir
        self.last_stats: dict[str, float] = {}
        # sync / readmit / group re-forming never interleave (module docstring)
        self._lock = threading.RLock()
        self._group_members: tuple[str, ...] | None = None  # xccl: servers in the group
        self.group_reforms = 0
        # after a refusal the actor holds the refused (newer) weights, not the servers'
        # version: until the next commit, that version can come from disk only
        self._actor_ahead_of: int | None = None

    def add_hook(self, hook: WeightSyncHook) -> None:
        if not isinstance(hook, WeightSyncHook):
            raise TypeError(f"add_hook expects a WeightSyncHook, got {type(hook).__name__}")
        self.hooks.append(hook)

    # ------------------------------------------------------------------ sync
    def sync(self, version: int, resume: bool = True, reason: str = "step") -> dict[str, float]:
        """Push the actor's weights to every server as ``version``; returns timings
        (``weight_sync/*``). ``resume=False`` leaves the executor paused (call
        ``resume()`` later); generation on the servers is resumed either way."""
        if self.meta is None:
            raise RuntimeError("WeightSynchronizer.sync: no WeightUpdateMeta (meta=None)")
        with self._lock:
            return self._sync(int(version), resume, reason)

    def _sync(self, version: int, resume: bool, reason: str) -> dict[str, float]:
        ctx = WeightSyncContext(
            version=version,
            previous_version=int(self._call(self.rollout, "get_version", default=0)),
            meta=self.meta.with_version(version),
            reason=reason,
            actor=self.actor,
            rollout=self.rollout,
            critic=self.critic,
        )
        t0 = time.monotonic()
        step = "pause"
        paused_executor = gen_paused = False
        transport: WeightTransport | None = None
        try:
            self.rollout.pause()
            paused_executor = True
            in_flight = self._in_flight(ctx.meta)
            if not in_flight:
                self._call(self.rollout, "pause_generation")
                gen_paused = True
            ctx.stats["weight_sync/pause_seconds"] = time.monotonic() - t0
            step = "regroup"
            if self._reform_group_if_needed(reason):
                ctx.meta = self.meta.with_version(version)
                ctx.stats["weight_sync/group_reforms"] = 1.0
            step = "before_push"
            for h in self.hooks:
                h.before_push(ctx)
            step = "transform"
            for h in self.hooks:
                ctx.meta = h.transform(ctx, ctx.meta)
            if in_flight and not self._in_flight(ctx.meta):  # e.g. now a LoRA adapter
                in_flight = False
                step = "pause"
                self._call(self.rollout, "pause_generation")
                gen_paused = True
            ctx.stats["weight_sync/in_flight"] = float(in_flight)
            transport = transport_for(ctx.meta)
            step = "export"
            t_push = time.monotonic()
            transport.export(ctx)
            ctx.stats["weight_sync/export_seconds"] = time.monotonic() - t_push
            step = "push"
            with waiting(
                logger,
                lambda: (
                    f"the {transport.name} push of weights version {version} to the servers "
                    f"{self._healthy()}"
                ),
            ):
                transport.push(ctx)
            ctx.stats["weight_sync/push_seconds"] = time.monotonic() - t_push
            step = "verify"
            for h in self.hooks:
                self._verify(h, ctx)
            step = "commit"
            transport.commit(ctx)
            self._actor_ahead_of = None
            self._set_trainer_versions(version)
            self._prune_disk_versions(version)
            step = "after_push"
            for h in self.hooks:
                h.after_push(ctx)
            step = "resume"
            if gen_paused:
                gen_paused = False
                self._call(self.rollout, "continue_generation")
            if resume:
                self.rollout.resume()
        except BaseException as e:
            if step in REFUSAL_STEPS and isinstance(e, Exception):
                return self._refused(ctx, transport, step, e, t0, paused_executor, resume)
            self._recover_from_failure(ctx, gen_paused, paused_executor, e)
            raise WeightSyncError(version, step, e) from e
        self.consecutive_refusals = 0
        ctx.stats["weight_sync/seconds"] = time.monotonic() - t0
        ctx.stats["weight_sync/consecutive_refusals"] = 0.0
        self.last_stats = dict(ctx.stats)
        logger.info(
            "weights of version %d synced (%s, %s) in %.2fs",
            version,
            reason,
            transport.name,
            ctx.stats["weight_sync/seconds"],
        )
        for h in self.hooks:
            try:
                h.after_sync(ctx)
            except Exception as e:  # noqa: BLE001 - the sync itself succeeded
                logger.error("%s.after_sync raised %s", type(h).__name__, e)
        return dict(ctx.stats)

    # ------------------------------------------------------------------ refusals
    def _refused(
        self,
        ctx: WeightSyncContext,
        transport: WeightTransport | None,
        step: str,
        error: Exception,
        t0: float,
        executor_paused: bool,
        resume: bool,
    ) -> dict[str, float]:
        """A refusal (module docstring): roll every server back, resume generation on the
        previous weights, count it; then continue (return) or stop (raise)."""
        self.consecutive_refusals += 1
        self.total_refusals += 1
        server, tensor = _where(error)
        logger.error(
            "weights of version %d refused at %r (server %s, tensor %s: %s: %s); rolling "
            "every server back to version %d (%d refusal(s) in a row)",
            ctx.version,
            step,
            server,
            tensor,
            type(error).__name__,
            error,
            ctx.previous_version,
            self.consecutive_refusals,
        )
        self._actor_ahead_of = ctx.previous_version
        if step != "export" and transport is not None:  # the servers were touched
            self._rollback(ctx, transport)
        self._count_refusal_in_staleness_bound(ctx.previous_version)
        if step == "push" and ctx.meta.type == "xccl" and self._group_members is not None:
            self._group_members = ()  # a broadcast may have failed half-way: re-form it
        limit = self.max_consecutive_refusals
        stop = limit is not None and self.consecutive_refusals >= max(limit, 1)
        self._recover_from_failure(ctx, True, executor_paused and (stop or resume), error)
        stats = {
            "weight_sync/refused": 1.0,
            "weight_sync/refusals": 1.0,
            "weight_sync/consecutive_refusals": float(self.consecutive_refusals),
            "weight_sync/seconds": time.monotonic() - t0,
        }
        stats_tracker.scalar(**{"weight_sync/refusals_total": float(self.total_refusals)})
        stats_tracker.scalar(
            **{"weight_sync/consecutive_refusals": stats["weight_sync/consecutive_refusals"]}
        )
        if stop:
            err = WeightSyncStopped(ctx.version, step, error, self.consecutive_refusals)
            self.last_refusal = err
            raise err from error
        self.last_refusal = WeightSyncError(ctx.version, step, error)
        self.last_refusal.__cause__ = error
        ctx.stats.update(stats)
        self.last_stats = dict(ctx.stats)
        return dict(ctx.stats)

    def _previous_weights_path(self, previous_version: int) -> str | None:
        """A directory with the weights of ``previous_version`` for servers that reload
        instead of restoring their own copy (disk: that version's directory; version 0:
        ``initial_weights_path``; None: none on disk)."""
        meta = self.meta
        if previous_version == 0:
            return self.initial_weights_path
        if meta is None or meta.type != "disk" or not meta.path:
            return None
        path = meta.with_version(previous_version).path
        return path if os.path.isdir(path) else None

    def _rollback(self, ctx: WeightSyncContext, transport: WeightTransport) -> None:
        try:
            excluded = transport.rollback(ctx, self._previous_weights_path(ctx.previous_version))
        except Exception as e:  # noqa: BLE001 - every server failed: out of rotation
            logger.error("rolling the servers back failed: %s", e)
            excluded = list(self._healthy())
            exclude = getattr(self.rollout, "exclude_server", None)
            for addr in excluded:
                if callable(exclude):
                    exclude(addr, f"could not roll back weights version {ctx.version}")
        if excluded:
            logger.warning(
                "servers %s could not be rolled back to version %d: out of rotation until "
                "readmitted with the current weights",
                excluded,
                ctx.previous_version,
            )

    def _prune_disk_versions(self, version: int) -> None:
        """Disk mode: delete the weight-update directories of versions older than
        ``version`` once every server holds ``version`` (a run would otherwise keep one
        full copy of the model per step). The current version's directory stays: a
        restarted server is readmitted from it."""
        meta = self.meta
        if meta is None or meta.type != "disk" or not meta.path:
            return
        root = os.path.dirname(meta.with_version(version).path)
        try:
            names = os.listdir(root)
        except OSError:
            return
        removed = 0
        for name in names:
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < version:
                path = os.path.join(root, name)
                try:
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
                    removed += 1
                except OSError as e:  # a full disk is worse than a leftover: log, go on
                    logger.warning("could not remove old weight-update path %s: %s", path, e)
        if removed:
            logger.debug("removed %d old weight-update directories under %s", removed, root)

    def flush(self) -> None:
        """Every hook's ``flush()`` (a step boundary: e.g. a background weight check's
        mismatch is raised here). Called from the thread that calls ``sync``; does not
        wait for a readmission in progress."""
        for h in self.hooks:
            h.flush()

    def resume(self) -> None:
        """Resume the executor left paused by ``sync(..., resume=False)``."""
        self.rollout.resume()

    def set_version(self, version: int) -> None:
        """Set ``version`` on every side without pushing (e.g. a resume at version 0)."""
        with self._lock:
            self._set_trainer_versions(int(version))
            self.rollout.set_version(int(version))

    def _set_trainer_versions(self, version: int) -> None:
        self.actor.set_version(version)
        if self.critic is not None:
            self.critic.set_version(version)

    def _recover_from_failure(
        self, ctx: WeightSyncContext, gen_paused: bool, executor_paused: bool, error: BaseException
    ) -> None:
        if gen_paused:
            try:
                self._call(self.rollout, "continue_generation")
            except Exception as e:  # noqa: BLE001 - the original error is what matters
                logger.error("resuming generation after a failed weight sync failed: %s", e)
        if executor_paused:
            try:
                self.rollout.resume()
            except Exception as e:  # noqa: BLE001
                logger.error("resuming the rollout after a failed weight sync failed: %s", e)
        for h in self.hooks:
            try:
                h.on_error(ctx, error)
            except Exception as e:  # noqa: BLE001
                logger.error("%s.on_error raised %s", type(h).__name__, e)

    def _in_flight(self, meta: WeightUpdateMeta) -> bool:
        """The servers take ``meta`` while they generate (``updates_in_flight``): no
        pause of generation, the new weights go live at commit."""
        fn = getattr(self.rollout, "updates_in_flight", None)
        return bool(fn(meta)) if callable(fn) else False

    def _count_refusal_in_staleness_bound(self, version: int) -> None:
        """The trainer consumed a batch that moved no version: let the rollout's staleness
        bound count it (``StalenessManager.on_sync_refused``), or with
        ``max_head_offpolicyness = 0`` the next step's batch could never start."""
        try:
            sm = getattr(self.rollout, "staleness_manager", None)
        except RuntimeError:  # no executor (a rollout client that generates nothing)
            sm = None
        if sm is not None and callable(getattr(sm, "on_sync_refused", None)):
            sm.on_sync_refused(version)

    @staticmethod
    def _call(obj: Any, name: str, default: Any = None) -> Any:
        fn = getattr(obj, name, None)
        return fn() if callable(fn) else default

    def _healthy(self) -> list[str]:
        return list(getattr(self.rollout, "healthy_addresses", []) or [])

    def _verify(self, hook: WeightSyncHook, ctx: WeightSyncContext) -> None:
        """``hook.verify(ctx)``; a *transport* failure (a server killed, hung or whose
        connection dropped while it answered) is not a verdict on the weights: servers
        that no longer answer their health endpoint are taken out of rotation (the
        ``ServerWatchdog`` restarts them with the current weights) and the check runs once
        more on the servers in rotation. A mismatch is raised at once."""
        try:
            hook.verify(ctx)
            return
        except (ConnectionError, TimeoutError, OSError) as e:  # requests' errors are OSErrors
            first = e
        logger.warning(
            "%s.verify could not reach a server (%s: %s); checking which servers answer",
            type(hook).__name__,
            type(first).__name__,
            first,
        )
        exclude = getattr(self.rollout, "exclude_server", None)
        for addr in self._healthy():
            if not _answers_health(self.rollout, addr) and callable(exclude):
                exclude(addr, "no answer during the weight verification")
        if not self._healthy():
            raise first
        hook.verify(ctx)

    # ------------------------------------------------------------------ xccl group
    def _reform_group_if_needed(self, reason: str) -> bool:
        """``xccl``: re-form the weight-update group when the servers in rotation are not
        the ones it was formed with (module docstring). Returns whether it did."""
        meta = self.meta
        if meta is None or meta.type != "xccl" or not hasattr(self.actor, "connect_engine"):
            return False
        members = tuple(sorted(self._healthy()))
        if self._group_members is None:
            self._group_members = members  # formed at start-up (connect_engine)
            return False
        if members == self._group_members or not members:
            return False
        from areal.utils.network import find_free_ports

        self.group_reforms += 1
        base = meta.group_name.split("-r")[0]
        new = dataclasses.replace(
            meta,
            master_port=find_free_ports(1)[0],
            group_name=f"{base}-r{self.group_reforms}",
            world_size=0,
            version=None,
        )
        t0 = time.monotonic()
        logger.warning(
            "servers in rotation changed (%s -> %s): re-forming the weight-update group as "
            "%r at %s:%d before the %s sync",
            list(self._group_members),
            list(members),
            new.group_name,
            new.master_address,
            new.master_port,
            reason,
        )
        if hasattr(self.actor, "weight_update_group_initialized"):
            self.actor.weight_update_group_initialized = False
        with waiting(
            logger,
            lambda: f"servers {list(members)} and training rank 0 to join {new.group_name!r}",
        ):
            self.actor.connect_engine(self.rollout, new)
        self.meta = new
        self._group_members = members
        logger.info(
            "weight-update group %r formed with %d server(s) in %.2fs",
            new.group_name,
            len(members),
            time.monotonic() - t0,
        )
        return True

    # ------------------------------------------------------------------ restarted servers
    def current_weights(self) -> tuple[str | None, int]:
        """(Hugging Face directory holding the servers' current weights, or None for the
        initial model; the current version)."""
        version = int(self.rollout.get_version())
        if version == 0:
            return None, 0  # the server command loads the initial model
        meta = self.meta
        if meta is not None and meta.type == "disk" and meta.path:
            path = meta.with_version(version).path
            if os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path)):
                return path, version
        if self.actor is None or self.scratch_dir is None:
            raise RuntimeError(
                f"no weights of version {version} on disk and no actor/scratch_dir to write them"
            )
        path = os.path.join(self.scratch_dir, f"v{version}")
        if not os.path.isdir(path) and self._actor_ahead_of == version:
            raise RuntimeError(
                f"no weights of version {version} on disk, and the actor holds the weights "
                f"refused at the last sync, not version {version}'s: a server can be "
                f"readmitted once a sync succeeds"
            )
        if not os.path.isdir(path):
            if os.path.isdir(self.scratch_dir):  # older versions are of no use any more
                shutil.rmtree(self.scratch_dir, ignore_errors=True)
            self.actor.save(SaveLoadMeta(path=path, weight_format="hf", with_optim=False))
        return path, version

    def can_readmit_without_actor(self) -> bool:
        """Whether ``readmit`` needs no call into the actor now (version 0, or ``disk`` mode
        with the current version's directory on disk), so it may run on a background
        thread while the training thread uses the actor."""
        with self._lock:
            version = int(self.rollout.get_version())
            if version == 0:
                return True
            meta = self.meta
            if meta is None or meta.type != "disk" or not meta.path:
                return False
            path = meta.with_version(version).path
            return os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))

    def readmit(
        self, address: str, replaces: str | None = None, allow_actor: bool = True
    ) -> tuple[str | None, int] | None:
        """Load the current weights into the (restarted) server at ``address``, give it the
        current version (paused if the rollout is paused) and put it back in rotation.
        Holds the sync lock, so no sync runs in between. Returns (weights directory or
        None, version); ``None`` without doing anything when ``allow_actor=False`` and the
        weights would have to come from the actor. ``xccl``: the next ``sync`` re-forms
        the group with it."""
        with self._lock:
            if not allow_actor and not self.can_readmit_without_actor():
                return None
            path, version = self.current_weights()
            self.rollout.readmit_server(
                address, weights_path=path, version=version, replaces=replaces
            )
            return path, version
