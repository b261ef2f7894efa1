"""Distributed statistics tracker (AReaL-style API).

Usage::

    from areal.utils import stats_tracker

    with stats_tracker.scope("actor"):
        stats_tracker.denominator(n_tokens=loss_mask.bool())
        stats_tracker.stat(importance_weight=ratio, denominator="n_tokens")
        stats_tracker.scalar(lr=1e-5)
        with stats_tracker.record_timing("train_step"):
            ...
    stats = stats_tracker.export(reduce_group=dp_group)  # {"actor/importance_weight/avg": ...}

Recording never synchronises with the host: tensors are kept (detached) and only reduced
at :func:`export`, where all keys of all ranks are reduced with a fixed, small number of
collectives (one ``all_gather_object`` for the key set, then one ``all_reduce`` each for
sums, minima and maxima).

Output keys:

* ``denominator(name=mask)`` -> ``"<scope>/name"``: number of ``True`` entries (summed).
* ``stat(key=t, denominator=name)`` (default ``ReduceType.AVG_MIN_MAX``) ->
  ``"<scope>/key/avg"``, ``"/min"``, ``"/max"`` over the entries where the denominator mask
  is ``True``; ``AVG``/``SUM``/``MIN``/``MAX`` give a single ``"<scope>/key"``.
* ``scalar(key=x)`` -> ``"<scope>/key"`` (mean of the recorded values) and
  ``"<scope>/key__count"``.
* ``record_timing(key)`` -> ``"timeperf/key"`` (seconds, mean over recordings).

Keys whose masks selected nothing are left out of the export.

Scopes are per thread, so the rollout thread and the training loop can record into the same
tracker concurrently; the record store itself is guarded by a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist

from areal.utils import logging

logger = logging.getLogger("StatsTracker")

__all__ = [
    "ReduceType",
    "DistributedStatsTracker",
    "DEFAULT_TRACKER",
    "get",
    "export_all",
    "reset_all",
    "scope",
    "scope_func_wrapper",
    "denominator",
    "stat",
    "scalar",
    "record_timing",
    "export",
]


class ReduceType(Enum):
    """How a recorded key is reduced at export."""

    AVG_MIN_MAX = auto()
    AVG = auto()
    SUM = auto()
    MIN = auto()
    MAX = auto()
    SCALAR = auto()


@dataclass
class _Entry:
    reduce_type: ReduceType
    # tensor records: (values, mask) pairs; mask is None for denominators (values are the mask)
    records: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)


class DistributedStatsTracker:
    """Collects masked tensor statistics and scalars; reduces them across ranks on export."""

    def __init__(self, name: str = ""):
        self.name = name.strip("/")
        self._lock = threading.RLock()
        self._local = threading.local()
        self._entries: dict[str, _Entry] = {}
        # latest mask recorded under each full denominator key
        self._denominators: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ scopes
    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = [self.name] if self.name else []
            self._local.stack = stack
        return stack

    @contextmanager
    def scope(self, name: str) -> Iterator[DistributedStatsTracker]:
        """Prefix every key recorded inside the block with ``name/`` (nestable, per thread)."""
        stack = self._stack()
        stack.append(name.strip("/"))
        try:
            yield self
        finally:
            stack.pop()

    def scope_func_wrapper(self, name: str) -> Callable:
        """Decorator: run the function inside ``scope(name)``."""

        def decorator(func: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self.scope(name):
                    return func(*args, **kwargs)

            wrapper.__name__ = getattr(func, "__name__", "wrapper")
            wrapper.__doc__ = func.__doc__
            return wrapper

        return decorator

    @contextmanager
    def disable_scope(self) -> Iterator[None]:
        """Record keys without any scope prefix inside the block (this thread only)."""
        saved = self._stack()
        self._local.stack = []
        try:
            yield
        finally:
            self._local.stack = saved

    def _full_key(self, key: str) -> str:
        stack = [s for s in self._stack() if s]
        return "/".join([*stack, key]) if stack else key

    def _entry(self, full_key: str, reduce_type: ReduceType) -> _Entry:
        entry = self._entries.get(full_key)
        if entry is None:
            entry = _Entry(reduce_type)
            self._entries[full_key] = entry
        elif entry.reduce_type != reduce_type:
            raise ValueError(
                f"stats key {full_key!r} was recorded with reduce type "
                f"{entry.reduce_type.name}, now {reduce_type.name}"
            )
        return entry

    # --------------------------------------------------------------- recording
    def denominator(self, **masks: torch.Tensor) -> None:
        """Record boolean masks; later ``stat(denominator=name)`` calls average over them."""
        with self._lock:
            for key, mask in masks.items():
                if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                    got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
                    raise ValueError(f"denominator {key!r} must be a bool tensor, got {got}")
                full_key = self._full_key(key)
                mask = mask.detach()
                self._denominators[full_key] = mask
                self._entry(full_key, ReduceType.SUM).records.append((mask, None))

    def stat(
        self,
        denominator: str,
        reduce_type: ReduceType | None = None,
        **values: torch.Tensor,
    ) -> None:
        """Record float tensors, masked by the latest mask recorded as ``denominator`` in scope."""
        reduce_type = ReduceType.AVG_MIN_MAX if reduce_type is None else reduce_type
        if reduce_type == ReduceType.SCALAR:
            raise ValueError(
                "reduce_type=SCALAR is for scalar(); tensors use AVG_MIN_MAX/AVG/SUM/MIN/MAX"
            )
        with self._lock:
            denom_key = self._full_key(denominator)
            mask = self._denominators.get(denom_key)
            if mask is None:
                raise ValueError(
                    f"denominator {denom_key!r} was not recorded; call denominator({denominator}=mask) first"
                )
            for key, value in values.items():
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"stat {key!r} must be a float tensor, got {got}")
                if value.shape != mask.shape:
                    raise ValueError(
                        f"stat {key!r} has shape {tuple(value.shape)} but denominator "
                        f"{denom_key!r} has shape {tuple(mask.shape)}"
                    )
                full_key = self._full_key(key)
                self._entry(full_key, reduce_type).records.append((value.detach(), mask))

    def scalar(self, **values: float) -> None:
        """Record plain numbers; exported as their mean (and ``__count``)."""
        with self._lock:
            for key, value in values.items():
                self._entry(self._full_key(key), ReduceType.SCALAR).scalars.append(float(value))

    @contextmanager
    def record_timing(self, key: str) -> Iterator[None]:
        """Time the block; exported (seconds) as ``timeperf/<key>``, outside any scope
        (and a ``timeperf.<key>`` span of the perf tracer when it is on)."""
        from areal.utils import perf_tracer

        start = time.perf_counter()
        try:
            with perf_tracer.trace_scope(f"timeperf.{key}", perf_tracer.Category.MISC):
                yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._entry(f"timeperf/{key}", ReduceType.SCALAR).scalars.append(elapsed)

    # ------------------------------------------------------------------ export
    def reset(self) -> None:
        with self._lock:
            self._entries = {}
            self._denominators = {}

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def export(
        self,
        key: str | None = None,
        reduce_group: dist.ProcessGroup | None = None,
        reset: bool = True,
    ) -> dict[str, float]:
        """Reduce everything recorded (or one ``key`` in the current scope) to floats.

        With ``reduce_group`` every rank of the group must call ``export`` (collectives);
        sums and counts are summed, minima/maxima are reduced with MIN/MAX, scalars are
        averaged over all recordings of all ranks.
        """
        with self._lock:
            if key is not None:
                keys = [self._full_key(key)]
                entries = {k: self._entries[k] for k in keys if k in self._entries}
            else:
                entries = dict(self._entries)
            if reduce_group is not None:
                gathered: list[Any] = [None] * dist.get_world_size(reduce_group)
                local = {k: e.reduce_type.name for k, e in entries.items()}
                dist.all_gather_object(gathered, local, group=reduce_group)
                all_types: dict[str, str] = {}
                for d in gathered:
                    all_types.update(d)
                for k, t in all_types.items():
                    if k not in entries:
                        entries[k] = _Entry(ReduceType[t])
            result = self._reduce(entries, reduce_group)
            if reset:
                if key is None:
                    self.reset()
                else:
                    for k in entries:
                        self._entries.pop(k, None)
                        self._denominators.pop(k, None)
            return result

    def _reduce(
        self, entries: dict[str, _Entry], group: dist.ProcessGroup | None
    ) -> dict[str, float]:
        names = sorted(entries)
        device = _reduce_device(group)
        n = len(names)
        # per key: [masked sum, count] ; min ; max
        sums = torch.zeros(n, 2, dtype=torch.float64, device=device)
        mins = torch.full((n,), float("inf"), dtype=torch.float64, device=device)
        maxs = torch.full((n,), float("-inf"), dtype=torch.float64, device=device)
        for i, k in enumerate(names):
            e = entries[k]
            if e.reduce_type == ReduceType.SCALAR:
                if e.scalars:
                    sums[i, 0] = sum(e.scalars)
                    sums[i, 1] = len(e.scalars)
                continue
            if not e.records:
                continue
            s, c, lo, hi = _local_reduce(e.records)
            sums[i, 0] = s.to(device)
            sums[i, 1] = c.to(device)
            mins[i] = lo.to(device)
            maxs[i] = hi.to(device)
        if group is not None and n > 0:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
        sums_l = sums.cpu().tolist()
        mins_l = mins.cpu().tolist()
        maxs_l = maxs.cpu().tolist()
        out: dict[str, float] = {}
        for i, k in enumerate(names):
            rt = entries[k].reduce_type
            s, c = sums_l[i]
            if rt == ReduceType.SCALAR:
                if c > 0:
                    out[k] = s / c
                    out[k + "__count"] = int(c)
                continue
            if rt == ReduceType.SUM:
                out[k] = s
                continue
            if c == 0:
                continue
            if rt == ReduceType.AVG_MIN_MAX:
                out[k + "/avg"] = s / c
                out[k + "/min"] = mins_l[i]
                out[k + "/max"] = maxs_l[i]
            elif rt == ReduceType.AVG:
                out[k] = s / c
            elif rt == ReduceType.MIN:
                out[k] = mins_l[i]
            elif rt == ReduceType.MAX:
                out[k] = maxs_l[i]
        return out


def _reduce_device(group: dist.ProcessGroup | None) -> torch.device:
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_reduce(
    records: list[tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked sum, count, min, max over all records (tensor ops, one host transfer later)."""
    s = c = None
    lo = hi = None
    for values, mask in records:
        if mask is None:  # denominator: the value is the count of True entries
            v = values.to(torch.float64).sum()
            cnt = torch.ones((), dtype=torch.float64, device=values.device)
            vmin = vmax = v
        else:
            m = mask.to(values.device)
            vals = values.to(torch.float64)
            v = torch.where(m, vals, 0.0).sum()
            cnt = m.sum().to(torch.float64)
            vmin = (
                torch.where(m, vals, float("inf")).min()
                if vals.numel()
                else v.new_tensor(float("inf"))
            )
            vmax = (
                torch.where(m, vals, float("-inf")).max()
                if vals.numel()
                else v.new_tensor(float("-inf"))
            )
        if s is not None and v.device != s.device:
            v, cnt, vmin, vmax = (t.to(s.device) for t in (v, cnt, vmin, vmax))
        s = v if s is None else s + v
        c = cnt if c is None else c + cnt
        lo = vmin if lo is None else torch.minimum(lo, vmin)
        hi = vmax if hi is None else torch.maximum(hi, vmax)
    return s, c, lo, hi


DEFAULT_TRACKER = DistributedStatsTracker()
_TRACKERS: dict[str, DistributedStatsTracker] = {"": DEFAULT_TRACKER}
_TRACKERS_LOCK = threading.Lock()


def get(name: str = "") -> DistributedStatsTracker:
    """The named tracker (created on first use); ``get("")`` is ``DEFAULT_TRACKER``."""
    with _TRACKERS_LOCK:
        tracker = _TRACKERS.get(name)
        if tracker is None:
            tracker = DistributedStatsTracker(name)
            _TRACKERS[name] = tracker
        return tracker


def export_all(
    reduce_group: dist.ProcessGroup | None = None, reset: bool = True
) -> dict[str, float]:
    """Export every named tracker (keys of named trackers are prefixed by their name)."""
    with _TRACKERS_LOCK:
        names = list(_TRACKERS)
    if reduce_group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(reduce_group)
        dist.all_gather_object(gathered, names, group=reduce_group)
        names = sorted({n for ns in gathered for n in ns})
    out: dict[str, float] = {}
    for name in names:
        stats = get(name).export(reduce_group=reduce_group, reset=reset)
        dup = set(stats) & set(out)
        if dup:
            logger.warning("Duplicate stats keys across trackers: %s", sorted(dup))
        out.update(stats)
    return out


def reset_all() -> None:
    """Drop what every tracker holds, unexported (a fresh start within one process)."""
    with _TRACKERS_LOCK:
        trackers = list(_TRACKERS.values())
    for tracker in trackers:
        tracker.reset()


scope = DEFAULT_TRACKER.scope
scope_func_wrapper = DEFAULT_TRACKER.scope_func_wrapper
disable_scope = DEFAULT_TRACKER.disable_scope
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
scalar = DEFAULT_TRACKER.scalar
record_timing = DEFAULT_TRACKER.record_timing
export = DEFAULT_TRACKER.export
