"""``TrainController``: drives ``world_size`` remote train-engine workers from the controller.

Usage (what the trainer does)::

    scheduler = LocalScheduler(exp_config=config)
    actor = TrainController("areal.trainer.ppo.actor.FSDPPPOActor", config.actor, scheduler)
    actor.initialize(role="actor", alloc_mode=alloc_mode, ft_spec=ft_spec)
    logp = actor.compute_logp(batch)          # [B, T], original order
    batch = actor.compute_advantages(batch)   # all ranks, whole groups, merged back
    stats = actor.ppo_update(batch)           # rank 0's stats
    actor.connect_engine(rollout_engine, WeightUpdateMeta.from_disk(...))
    actor.update_weights(meta)
    actor.destroy()

Dispatch rules (``custom_function_call``; any other engine method is forwarded by
attribute access, e.g. ``actor.step_lr_scheduler()``):

- Every argument that is a padded batch (a dict holding a 2-D ``attention_mask``
  tensor) is split across data-parallel ranks, balanced by token count: units (single
  sequences, or whole groups: the rows sharing a ``group_ids`` value when the batch has
  that key, else ``group_size`` consecutive sequences) are partitioned by
  the engine config's ``mb_spec.packing_algorithm``: ``"ffd"`` (default) sorts them by
  tokens, largest first, and gives each to the rank with the fewest tokens so far;
  ``"kk"`` uses Karmarkar-Karp (``areal.utils.seqpack.kk_partition``) and keeps the more
  even of the two splits. Inside a rank the original order is kept. All batch arguments of one call must have the same
  ``B`` and are split the same way. Other arguments are sent unchanged to every rank.
- All ranks are called concurrently (collectives need every rank); the first failure
  is raised at once (a dead worker wins over the collective errors it causes).
- Results: a tensor with leading dim equal to the rank's share (or a dict containing
  such tensors) is re-assembled into the ORIGINAL batch order (dim 1 right-padded with 0
  to the longest rank if lengths differ). Anything else (stats dicts, lists of stats,
  scalars, None) is taken from rank 0: engines reduce their stats across ranks.
- Calls without a batch argument are broadcast and rank 0's result is returned.

Batches held on the workers (the batch crosses once per step): ``put_batch(batch)``
sends each worker its shard (split as above) and returns a
:class:`~areal.infra.controller.batch_ref.BatchRef`; a call given that ref sends only a
handle, the workers run the method on the shard they hold, a returned batch (e.g.
``compute_advantages``) stays there (the ref is returned), and ``_store_as="key"``
stores a result (e.g. ``compute_logp``'s) under ``key`` there instead of returning it.
Other results merge as above. ``ref.free()`` drops it; ``stored_batches()`` says what
each worker holds. A plain dict works as before (sliced, shipped, merged back).

Reserved keyword arguments (consumed here, never forwarded): ``_group_size`` (override
``self.group_size`` for this call), ``_merge=False`` (return the per-rank list),
``_timeout`` (seconds, per worker call), ``_store_as`` (with a ``BatchRef``: see above).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from areal.api.actor_config import PPOActorConfig
from areal.api.engine_config import TrainEngineConfig
from areal.api.io_struct import FinetuneSpec, ParamSpec, SaveLoadMeta, WeightUpdateMeta
from areal.api.scheduler_api import Job, Scheduler, SchedulingSpec, Worker, WorkerDiedError
from areal.infra.controller.batch_ref import BatchRef
from areal.infra.controller.engine_calls import add_engine_calls
from areal.infra.daemon_threads import spawn_daemon
from areal.infra.rpc.batch_store import STORE_ENGINE, StoredBatch
from areal.infra.wait_log import WaitLog
from areal.utils import logging
from areal.utils.seqpack import kk_partition, partition_spread

logger = logging.getLogger("TrainController")

_RESERVED = ("_group_size", "_merge", "_timeout", "_store_as")


# ---------------------------------------------------------------------------- batches
def is_padded_batch(x: Any) -> bool:
    """A dict of tensors with a 2-D ``attention_mask`` ``[B, T]``."""
    return (
        isinstance(x, dict)
        and isinstance(x.get("attention_mask"), torch.Tensor)
        and x["attention_mask"].ndim == 2
    )


def balanced_partition(weights: list[int], n_parts: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``n_parts`` lists of near-equal total weight.

    Largest first, each to the currently lightest part (ties: fewer items, then lower
    part index); every part gets at least one item when ``len(weights) >= n_parts``.
    Each part is returned in ascending index order.
    """
    if len(weights) < n_parts:
        raise ValueError(f"Cannot split {len(weights)} units across {n_parts} data-parallel ranks")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    loads = [0] * n_parts
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    for i in order:
        k = min(range(n_parts), key=lambda j: (loads[j], len(parts[j]), j))
        parts[k].append(i)
        loads[k] += weights[i]
    return [sorted(p) for p in parts]


def kk_balanced_partition(weights: list[int], n_parts: int) -> list[list[int]]:
    """Like :func:`balanced_partition`, by Karmarkar-Karp; the greedy split is kept instead
    when it is more even (KK is a heuristic). Parts in ascending index order."""
    greedy = balanced_partition(weights, n_parts)
    kk = kk_partition(weights, n_parts)
    return kk if partition_spread(weights, kk) <= partition_spread(weights, greedy) else greedy


_DP_PARTITIONERS = {"ffd": balanced_partition, "kk": kk_balanced_partition}


def split_batch_indices(
    batch: dict, n_parts: int, group_size: int = 1, packing_algorithm: str | None = "ffd"
) -> list[torch.Tensor]:
    """Sequence indices per rank, balanced by ``attention_mask`` token counts; whole groups
    stay together. ``packing_algorithm``: ``"ffd"`` (greedy, default) or ``"kk"``.

    Groups: the rows sharing a ``batch["group_ids"]`` value when the batch has that key
    (any sizes, any order; ``group_size`` is then not used), else runs of ``group_size``
    consecutive rows. Each rank's indices are in ascending (original) order."""
    mask = batch["attention_mask"]
    bsz = mask.shape[0]
    partition = _DP_PARTITIONERS.get(packing_algorithm or "ffd")
    if partition is None:
        raise ValueError(
            f"packing_algorithm={packing_algorithm!r}; allowed: {sorted(_DP_PARTITIONERS)}"
        )
    group_ids = batch.get("group_ids")
    if isinstance(group_ids, torch.Tensor) and group_ids.shape[:1] == (bsz,):
        # units in order of first appearance: contiguous groups give the same split as
        # the group_size path below
        ids, unit_of_row = torch.unique(group_ids, return_inverse=True)
        first = torch.full((ids.numel(),), bsz, dtype=torch.long).scatter_reduce(
            0, unit_of_row, torch.arange(bsz), reduce="amin"
        )
        rank = torch.empty_like(first)
        rank[first.argsort()] = torch.arange(first.numel())
        unit_of_row = rank[unit_of_row]
        tokens = torch.zeros(ids.numel(), dtype=torch.long).index_add_(
            0, unit_of_row, mask.sum(1).long()
        )
        parts = partition([int(t) for t in tokens.tolist()], n_parts)
        unit_part = torch.empty(ids.numel(), dtype=torch.long)
        for k, part in enumerate(parts):
            unit_part[part] = k
        row_part = unit_part[unit_of_row]
        return [torch.nonzero(row_part == k).reshape(-1) for k in range(n_parts)]
    if group_size < 1 or bsz % group_size != 0:
        raise ValueError(f"Batch size {bsz} is not a multiple of group_size={group_size}")
    tokens = mask.reshape(bsz // group_size, -1).sum(1).tolist()
    parts = partition([int(t) for t in tokens], n_parts)
    return [
        torch.tensor(
            [u * group_size + j for u in part for j in range(group_size)], dtype=torch.long
        )
        for part in parts
    ]


def slice_batch(batch: dict, idx: torch.Tensor) -> dict:
    """Rows ``idx`` of every per-sequence entry (leading dim ``B``); other entries unchanged."""
    bsz = batch["attention_mask"].shape[0]
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == bsz:
            out[k] = v[idx]
        elif isinstance(v, list) and len(v) == bsz:
            out[k] = [v[i] for i in idx.tolist()]
        else:
            out[k] = v
    return out


def _is_rows(x: Any, n: int) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == n


def merge_rank_results(results: list[Any], indices: list[torch.Tensor]) -> Any:
    """Re-assemble per-rank results into the original batch order (see module doc)."""
    sizes = [len(i) for i in indices]
    first = results[0]
    if all(_is_rows(r, n) for r, n in zip(results, sizes)):
        return _merge_tensors(results, indices)
    if isinstance(first, dict) and all(isinstance(r, dict) for r in results):
        if any(all(_is_rows(r.get(k), n) for r, n in zip(results, sizes)) for k in first):
            return {
                k: (
                    _merge_tensors([r[k] for r in results], indices)
                    if all(_is_rows(r.get(k), n) for r, n in zip(results, sizes))
                    else v
                )
                for k, v in first.items()
            }
    return first


def _merge_tensors(tensors: list[torch.Tensor], indices: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].ndim >= 2:
        t_max = max(t.shape[1] for t in tensors)
        tensors = [
            t
            if t.shape[1] == t_max
            else torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, t_max - t.shape[1]))
            for t in tensors
        ]
    cat = torch.cat(tensors, dim=0)
    perm = torch.cat(indices)
    out = torch.empty_like(cat)
    out[perm] = cat
    return out


def _resolve_sizes(alloc_mode: Any, world_size: int | None) -> tuple[int, int]:
    if world_size is not None:
        return int(world_size), int(world_size)
    if alloc_mode is None:
        return 1, 1
    if isinstance(alloc_mode, int):
        return alloc_mode, alloc_mode
    if isinstance(alloc_mode, str):
        from areal.api.alloc_mode import AllocationMode

        alloc_mode = AllocationMode.from_str(alloc_mode)
    train = getattr(alloc_mode, "train", None) or alloc_mode
    ws = int(train.world_size)
    return ws, int(getattr(train, "dp_size", ws))


def _resolve(value: Any, timeout: float | None) -> Any:
    """Wait for a Future / run a coroutine / pass a plain value through."""
    if isinstance(value, Future):
        return value.result(timeout=timeout)
    if asyncio.iscoroutine(value):
        return asyncio.run(value)
    return value


def _resolve_or_raise(value: Any, what: str, timeout: float | None = None) -> Any:
    """``_resolve`` with errors re-raised as ``RuntimeError`` naming ``what``."""
    try:
        return _resolve(value, timeout)
    except Exception as e:
        raise RuntimeError(f"{what} failed: {e}") from e


# ---------------------------------------------------------------------------- controller
class TrainController:
    """Runs one train engine class on ``world_size`` RPC workers made by ``scheduler``.

    ``train_engine``: class or import path (``"areal.trainer.ppo.actor.FSDPPPOActor"``);
    each worker builds it as ``cls(config)``. ``group_size``: sequences per prompt kept
    on one rank when splitting (default: ``config.group_size`` if the config has one, else 1).
    """

    def __init__(
        self,
        train_engine: str | type,
        config: Any,
        scheduler: Scheduler,
        *,
        group_size: int | None = None,
        call_timeout: float | None = None,
    ):
        if isinstance(train_engine, type):
            train_engine = f"{train_engine.__module__}.{train_engine.__qualname__}"
        self.train_engine = train_engine
        self.config = config
        self.scheduler = scheduler
        # Default: the engine config's ``group_size`` (PPOActorConfig: samples per prompt).
        own = config.group_size if isinstance(config, PPOActorConfig) else None
        self.group_size = int(group_size or own or 1)
        self.call_timeout = call_timeout
        self.workers: list[Worker] = []
        self.dp_ranks: list[int] = []
        self.workers_is_dp_head: list[bool] = []
        self.world_size = 0
        self.dp_size = 0
        self.role: str | None = None
        self.alloc_mode: Any = None
        self.rollout: Any = None
        self.weight_update_meta: WeightUpdateMeta | None = None
        self.weight_update_group_initialized = False
        self._engines_ready: Future | None = None  # initialize's engine build (a thread)
        self._engines_failed = False

    # ------------------------------------------------------------------ lifecycle
    def initialize(
        self,
        role: str = "actor",
        alloc_mode: Any = None,
        ft_spec: FinetuneSpec | None = None,
        *,
        world_size: int | None = None,
        scheduling_spec: SchedulingSpec | None = None,
        wait: bool = True,
        after: TrainController | None = None,
        **kwargs,
    ) -> None:
        """Start the workers, build the engine on each, call ``initialize(addr=None, ft_spec, **kwargs)`` on all.

        ``alloc_mode``: an ``AllocationMode`` (``.train.world_size``/``.dp_size``), its
        string form, or an int; ``world_size`` overrides it (pure data parallel).
        ``wait=False`` returns once the worker processes are started (from this thread, so
        their parent-death signal is armed); a background thread waits until they are
        healthy (``scheduler.wait_workers``) and builds the engines; :meth:`wait_ready`
        joins it. The trainer starts the inference servers meanwhile. ``after``: a
        controller whose engines are built first (roles colocated on one worker must not
        build theirs concurrently).
        """
        self.role = role
        self.alloc_mode = alloc_mode
        self.world_size, self.dp_size = _resolve_sizes(alloc_mode, world_size)
        if scheduling_spec is not None:
            specs = [scheduling_spec]
        elif isinstance(self.config, TrainEngineConfig):
            specs = list(self.config.scheduling_spec or [])
        else:  # an engine with its own config type: one default task
            specs = []
        job = Job(
            replicas=self.world_size, tasks=specs or [SchedulingSpec(cpu=1, mem=4)], role=role
        )
        try:
            if wait:
                self.scheduler.create_workers(job)
                self.workers = self.scheduler.get_workers(role)
            else:  # healthy-wait on the engine thread (LocalScheduler; others wait here)
                self.scheduler.create_workers(job, wait=False)
        except BaseException:
            self.destroy()
            raise
        before = after._engines_ready if after is not None else None
        self._engines_ready = spawn_daemon(
            self._build_engines, ft_spec, kwargs, before, name=f"{role}-init"
        )
        if wait:
            self.wait_ready()

    def _build_engines(
        self, ft_spec: FinetuneSpec | None, kwargs: dict[str, Any], before: Future | None
    ) -> None:
        if not self.workers:
            self.workers = self.scheduler.get_workers(self.role)  # waits until healthy
        if before is not None:
            wait_futures([before])  # its failure is raised by its own wait_ready
        self._call_all(
            "create_engine",
            [((self.train_engine, self.config), {})] * self.world_size,
            create=True,
        )
        self._call_all(
            "initialize", [((), dict(addr=None, ft_spec=ft_spec, **kwargs))] * self.world_size
        )
        if self.dp_size == self.world_size:
            self.dp_ranks = list(range(self.world_size))
            self.workers_is_dp_head = [True] * self.world_size
        else:
            self.dp_ranks = self._call_all("data_parallel_rank", [((), {})] * self.world_size)
            self.workers_is_dp_head = self._call_all(
                "is_data_parallel_head", [((), {})] * self.world_size
            )
        logger.info(
            f"{self.train_engine} ready on {self.world_size} worker(s) of role {self.role!r} "
            f"(dp={self.dp_size})"
        )

    def wait_ready(self) -> None:
        """Block until the engines of :meth:`initialize` are built; on failure stop the
        workers and raise what failed. Idempotent."""
        ready = self._engines_ready
        if ready is None:
            return
        try:
            ready.result()
        except BaseException:
            if not self._engines_failed:
                self._engines_failed = True
                self.destroy()
            raise

    def destroy(self) -> None:
        """Call ``destroy`` on every engine (errors are logged), then stop the workers."""
        if self._engines_ready is not None:  # still being built: let that end first
            wait_futures([self._engines_ready])
        if self.workers:
            try:
                self._call_all("destroy", [((), {})] * len(self.workers), timeout=60)
            except Exception as e:  # noqa: BLE001 - teardown continues
                logger.warning(f"Engine destroy failed: {e}")
        if self.role is not None:
            self.scheduler.delete_workers(self.role)
        self.workers = []

    def __enter__(self) -> TrainController:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    # ------------------------------------------------------------------ dispatch
    def _call_all(
        self,
        method: str,
        per_rank: list[tuple[tuple, dict]],
        *,
        create: bool = False,
        timeout: float | None = None,
        workers: list[Worker] | None = None,
        companions: list[Future] | None = None,
        engine_name: str = "default",
    ) -> list[Any]:
        """Call ``method`` on every worker concurrently; fail fast on the first error.

        ``companions``: futures of work the workers' call depends on (e.g. the inference
        servers' side of a weight update); waited for as well, and their first error is
        raised as soon as it happens instead of after the workers' call gives up.
        """
        workers = self.workers if workers is None else workers
        timeout = self.call_timeout if timeout is None else timeout
        futs = []
        for w, (args, kwargs) in zip(workers, per_rank, strict=True):
            if create:
                fut = spawn_daemon(
                    self.scheduler.create_engine, w.id, *args, timeout=timeout, **kwargs
                )
            else:
                fut = spawn_daemon(
                    self.scheduler.call_engine,
                    w.id,
                    method,
                    *args,
                    engine_name=engine_name,
                    timeout=timeout,
                    **kwargs,
                )
            futs.append(fut)
        watched = futs + list(companions or [])
        # a long call says what it waits for (areal.infra.wait_log), every 10 s
        wait_log = WaitLog(logger, level="info")
        while True:
            done, pending = wait_futures(watched, timeout=1.0, return_when=FIRST_EXCEPTION)
            if not pending or any(f.exception() is not None for f in done):
                break
            wait_log.tick(
                lambda pending=pending: (
                    f"rpc {method!r} on "
                    f"{[w.id for w, f in zip(workers, futs) if f in pending] or 'no worker'}"
                    f" ({sum(f in pending for f in futs)} of {len(futs)} workers unfinished, "
                    f"{sum(f in pending for f in watched[len(futs) :])} companion(s) unfinished)"
                )
            )
        errors = [f.exception() for f in watched if f.done() and f.exception() is not None]
        if errors:
            first = errors[0]  # among the earliest failures (e.g. a companion's own error)
            # A peer's death makes the others fail in collectives; name the dead worker.
            end = time.monotonic() + 1.0
            while (
                not any(isinstance(e, WorkerDiedError) for e in errors) and time.monotonic() < end
            ):
                time.sleep(0.1)
                errors = [f.exception() for f in watched if f.done() and f.exception() is not None]
            died = [e for e in errors if isinstance(e, WorkerDiedError)]
            raise died[0] if died else first
        return [f.result() for f in futs]

    def custom_function_call(self, method: str, *args, **kwargs) -> Any:
        """Call ``engine.method`` on all ranks with batch arguments split by tokens (module doc)."""
        group_size = kwargs.pop("_group_size", None) or self.group_size
        merge = kwargs.pop("_merge", True)
        timeout = kwargs.pop("_timeout", None)
        store_as = kwargs.pop("_store_as", None)
        if not self.workers:
            raise RuntimeError(f"TrainController.{method}: not initialized (call initialize first)")
        values = list(args) + list(kwargs.values())
        refs = [a for a in values if isinstance(a, BatchRef)]
        if refs:
            return self._call_on_ref(method, refs, args, kwargs, merge, timeout, store_as)
        if store_as is not None:
            raise ValueError(f"{method}: _store_as needs a BatchRef argument (put_batch)")
        batches = [a for a in values if is_padded_batch(a)]
        if not batches:
            results = self._call_all(method, [(args, kwargs)] * len(self.workers), timeout=timeout)
            return results if not merge else results[0]
        sizes = {b["attention_mask"].shape[0] for b in batches}
        if len(sizes) != 1:
            raise ValueError(
                f"{method}: batch arguments have different batch sizes {sorted(sizes)}"
            )
        indices = self._split(batches[0], group_size)
        per_rank = []
        for dp in self.dp_ranks:
            idx = indices[dp]
            r_args = tuple(slice_batch(a, idx) if is_padded_batch(a) else a for a in args)
            r_kwargs = {
                k: slice_batch(v, idx) if is_padded_batch(v) else v for k, v in kwargs.items()
            }
            per_rank.append((r_args, r_kwargs))
        results = self._call_all(method, per_rank, timeout=timeout)
        if not merge:
            return results
        return self.merge_results(results, indices)

    def _split(self, batch: dict, group_size: int | None = None) -> list[torch.Tensor]:
        packing = (
            self.config.mb_spec.packing_algorithm
            if isinstance(self.config, TrainEngineConfig)
            else None
        )
        return split_batch_indices(batch, self.dp_size, group_size or self.group_size, packing)

    def head_results(self, results: list[Any]) -> list[Any]:
        """One result per data-parallel rank (its head worker's), in rank order."""
        head = [
            (dp, r)
            for r, dp, is_head in zip(results, self.dp_ranks, self.workers_is_dp_head)
            if is_head
        ]
        return [r for _, r in sorted(head, key=lambda t: t[0])]

    def merge_results(self, results: list[Any], indices: list[torch.Tensor]) -> Any:
        """Every worker's result -> one, per-row tensors in the original order (module doc)."""
        return merge_rank_results(self.head_results(results), indices)

    # ------------------------------------------------------------------ held batches
    def put_batch(self, batch: dict, *, _group_size: int | None = None) -> BatchRef:
        """Send each worker its shard of ``batch`` once; the returned ref stands for it."""
        if not self.workers:
            raise RuntimeError("TrainController.put_batch: not initialized (call initialize first)")
        if not is_padded_batch(batch):
            raise ValueError("put_batch: a padded batch (dict with a 2-D attention_mask) is needed")
        indices = self._split(batch, _group_size)
        ref_id = f"{self.role}-{uuid.uuid4().hex[:12]}"
        per_rank = [((ref_id, slice_batch(batch, indices[dp])), {}) for dp in self.dp_ranks]
        self._call_all("put", per_rank, engine_name=STORE_ENGINE)
        return BatchRef(self, ref_id, indices, int(batch["attention_mask"].shape[0]))

    def stored_batches(self) -> list[dict[str, Any]]:
        """What each worker holds now: ``{"n_batches", "bytes", "ref_ids"}`` per worker."""
        return self._call_all("info", [((), {})] * len(self.workers), engine_name=STORE_ENGINE)

    def _call_on_ref(self, method, refs, args, kwargs, merge, timeout, store_as) -> Any:
        ref = refs[0]
        if any(r is not ref for r in refs) or ref.controller is not self:
            raise ValueError(
                f"{method}: one BatchRef of this controller's workers (role {self.role!r}) "
                f"per call; got {refs}"
            )
        if any(is_padded_batch(a) for a in list(args) + list(kwargs.values())):
            raise ValueError(f"{method}: a BatchRef and a plain batch in one call")
        handle = ref.handle(store_as)
        args = tuple(handle if a is ref else a for a in args)
        kwargs = {k: handle if v is ref else v for k, v in kwargs.items()}
        results = self._call_all(method, [(args, kwargs)] * len(self.workers), timeout=timeout)
        if not merge:
            return results
        merged = self.merge_results(results, ref.indices)
        return ref if isinstance(merged, StoredBatch) else merged

    # ------------------------------------------------------------------ engine API
    def train(self, mode: bool = True) -> TrainController:
        self.custom_function_call("train", mode)
        return self

    def eval(self) -> TrainController:
        return self.train(False)

    def train_batch(self, input_: dict, loss_fn: Any, loss_weight_fn: Any) -> dict[str, float]:
        """Split by tokens; ``loss_fn``/``loss_weight_fn`` must be importable module-level functions. Rank 0's stats."""
        return self.custom_function_call("train_batch", input_, loss_fn, loss_weight_fn)

    def eval_batch(self, input_: dict, loss_fn: Any, loss_weight_fn: Any) -> Any:
        return self.custom_function_call("eval_batch", input_, loss_fn, loss_weight_fn)

    def forward_batch(self, input_: dict, *args, **kwargs) -> Any:
        """Per-token outputs ``[B, T]`` in the original order."""
        return self.custom_function_call("forward_batch", input_, *args, **kwargs)

    def compute_logp(self, batch: dict | BatchRef, *args, **kwargs) -> torch.Tensor | None:
        """``[B, T]`` logprobs; with a ``BatchRef`` and ``_store_as=key``: kept there, None."""
        return self.custom_function_call("compute_logp", batch, *args, **kwargs)

    def compute_advantages(self, batch: dict | BatchRef, *args, **kwargs) -> dict | BatchRef:
        """Split by whole groups (``group_size`` = samples per prompt) across all ranks,
        merged back into the original order.

        With a ``BatchRef`` the advantages stay on the workers and the ref is returned.
        Every rank must take part: ``PPOActor.compute_advantages`` normalises at batch
        level with all-reduces over the data-parallel group, and group normalisation needs
        whole groups on one rank. Non-per-sequence entries of the result come from rank 0.
        """
        return self.custom_function_call("compute_advantages", batch, *args, **kwargs)

    def ppo_update(self, batch: dict | BatchRef, *args, **kwargs) -> Any:
        """Split by tokens (whole groups); returns rank 0's list of stats."""
        return self.custom_function_call("ppo_update", batch, *args, **kwargs)

    def save(self, meta: SaveLoadMeta) -> Any:
        """Rank 0's answer: ``True`` when an asynchronous write is pending (finish it with
        ``wait_async_save()``, forwarded to every rank)."""
        return self.custom_function_call("save", meta)

    def load(self, meta: SaveLoadMeta) -> None:
        self.custom_function_call("load", meta)

    def step_lr_scheduler(self) -> None:
        self.custom_function_call("step_lr_scheduler")

    def scale_lr(self, factor: float) -> float:
        """Every rank's learning rate times ``factor``; returns rank 0's new value."""
        return self.custom_function_call("scale_lr", float(factor))

    def set_version(self, version: int) -> None:
        self.custom_function_call("set_version", version)

    def get_version(self) -> int:
        return self.custom_function_call("get_version")

    def export_stats(self) -> dict[str, float]:
        """Rank 0's stats (engines reduce across ranks, so every rank has the same)."""
        return self.custom_function_call("export_stats")

    # ------------------------------------------------------------------ weight sync
    def connect_engine(self, engine: Any, meta: WeightUpdateMeta) -> None:
        """Remember the controller-side inference engine that ``update_weights`` feeds.

        The inference engine lives in the controller, not in the workers: the workers get
        ``connect_engine(None, meta)`` and their rank 0 only takes part in the transfer.
        ``xccl``: the weight-update group is formed here, once: the servers join it
        (``engine.init_weights_update_group(meta)``, which also sets ``meta.world_size``)
        while the workers' ``init_weights_update_group(meta)`` makes training rank 0 join
        it. The join is a rendezvous, so both sides run concurrently and are waited for;
        either side failing raises here (the other gives up within ``meta.timeout_s``).
        """
        self.rollout = engine
        self.weight_update_meta = meta
        if meta.type != "xccl" or self.weight_update_group_initialized:
            self._call_all("connect_engine", [((None, meta), {})] * len(self.workers))
            return
        t0 = time.monotonic()
        servers_join = spawn_daemon(
            _resolve_or_raise,
            engine.init_weights_update_group(meta),  # sets meta.world_size before it ships
            f"inference servers joining weight-update group {meta.group_name!r} "
            f"at {meta.master_address}:{meta.master_port}",
            name="xccl-join",
        )
        self._call_all("connect_engine", [((None, meta), {})] * len(self.workers))
        self._call_all(
            "init_weights_update_group",
            [((meta,), {})] * len(self.workers),
            companions=[servers_join],
        )
        self.weight_update_group_initialized = True
        logger.info(
            "weight-update group %r formed (world_size=%d) in %.2fs",
            meta.group_name,
            meta.world_size,
            time.monotonic() - t0,
        )

    def _announce_buckets(self, meta: WeightUpdateMeta, buckets: list[list[ParamSpec]]) -> None:
        """Announce each bucket to the servers and wait until they received it (they post
        the receives of a bucket only after its announcement). Pausing generation around
        the buckets is the caller's (``WeightSynchronizer``)."""
        for i, bucket in enumerate(buckets):
            _resolve_or_raise(
                self.rollout.update_weights_from_distributed(meta, bucket),
                f"inference servers receiving bucket {i + 1}/{len(buckets)} "
                f"({len(bucket)} tensors) of weight version {meta.version}",
            )

    def save_lora_adapter(self, path: str) -> int:
        """Every rank writes the LoRA adapter only (rank 0 writes; its byte count)."""
        return self._call_all("save_lora_adapter", [((path,), {})] * len(self.workers))[0]

    def export_weight_shards(self, path: str) -> int:
        """Every rank writes its share of the exported tensors into ``path``
        (``areal.api.weights_api``); the bytes written by all ranks."""
        return sum(self._call_all("export_weight_shards", [((path,), {})] * len(self.workers)))

    def weight_delta_state(self) -> dict[str, Any]:
        """Rank 0's kept base of the delta transport (``FSDPEngine.weight_delta_state``)."""
        return self._call_all("weight_delta_state", [((), {})] * len(self.workers))[0]

    def export_weight_delta(
        self, path: str | None, base_version: int | None, version: int, dtype: str
    ) -> dict[str, Any]:
        """Every rank exports the weight delta (collective; ``areal.api.weights_api``);
        rank 0's manifest."""
        args = ((path, base_version, version, dtype), {})
        return self._call_all("export_weight_delta", [args] * len(self.workers))[0]

    def commit_weight_delta(self, version: int, committed: bool = True) -> dict[str, Any]:
        """Every rank moves (``committed``) or keeps its delta base; rank 0's state."""
        args = ((version, committed), {})
        return self._call_all("commit_weight_delta", [args] * len(self.workers))[0]

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the current weights to the connected inference engine.

        ``disk``: every rank calls ``save(SaveLoadMeta(meta.path, "hf"))`` (rank 0 writes
        the Hugging Face directory), then the controller-side
        ``engine.update_weights_from_disk(meta)`` makes the servers reload it.
        ``xccl`` (group formed by ``connect_engine``): rank 0's ``get_param_specs`` buckets
        are announced one by one through ``engine.update_weights_from_distributed(meta,
        bucket)`` (each waits until the servers received that bucket) while all ranks run
        ``update_weights(meta)`` (rank 0 broadcasts the same buckets in the same order).
        A failure on either side is raised at once. Resuming the rollout and setting
        versions stay with the caller.
        """
        if self.rollout is None:
            raise RuntimeError(
                "update_weights: no inference engine; call connect_engine(engine, meta) first"
            )
        if meta.type == "disk":
            if getattr(meta, "use_lora", False):  # LoRA adapter only (areal.engine.lora)
                self._call_all("save_lora_adapter", [((meta.path,), {})] * len(self.workers))
            else:
                self.save(SaveLoadMeta(path=meta.path, weight_format="hf", with_optim=False))
            _resolve(self.rollout.update_weights_from_disk(meta), self.call_timeout)
        elif meta.type == "xccl":
            if not self.weight_update_group_initialized:
                raise RuntimeError("update_weights(xccl): call connect_engine(engine, meta) first")
            buckets = self.scheduler.call_engine(
                self.workers[0].id,
                "get_param_specs",
                meta.weight_chunked_mem_mb,
                timeout=self.call_timeout,
            )
            announce = spawn_daemon(self._announce_buckets, meta, buckets, name="xccl-announce")
            self._call_all(
                "update_weights", [((meta,), {})] * len(self.workers), companions=[announce]
            )
        else:
            raise ValueError(f"Unknown WeightUpdateMeta.type {meta.type!r}")


def start_train_controller(
    train_engine: str | type,
    config: Any,
    scheduler: Scheduler,
    role: str,
    *,
    alloc_mode: Any = None,
    ft_spec: FinetuneSpec | None = None,
    group_size: int | None = None,
    call_timeout: float | None = None,
    wait: bool = True,
    after: TrainController | None = None,
    **init_kwargs,
) -> TrainController:
    """Construct a role's ``TrainController`` and start it (``initialize``: workers,
    engines, ``engine.initialize(..., **init_kwargs)``); a failed start leaves no worker.
    ``wait=False``: the engines are still being built on return; call ``wait_ready()``
    (or ``destroy()``) on the controller. ``after``: build once that controller's are."""
    controller = TrainController(
        train_engine, config, scheduler, group_size=group_size, call_timeout=call_timeout
    )
    controller.initialize(
        role=role, alloc_mode=alloc_mode, ft_spec=ft_spec, wait=wait, after=after, **init_kwargs
    )
    return controller


add_engine_calls(TrainController)
