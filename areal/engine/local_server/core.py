"""Generation core of the built-in inference server: continuous batching over a KV cache.

One scheduler thread owns the model. Requests wait in a queue; at every iteration the
scheduler (1) runs pending commands (abort, pause, weight reload, ...), (2) prefills the
newly admitted requests together (left-padded) and merges their KV cache into the running
batch, (3) runs one decode step for every running request and (4) lets finished requests
leave at once.

The running batch keeps one KV buffer per layer shaped ``[B, kv_heads, capacity, head_dim]``
with left padding: row ``b`` holds its tokens in the last ``len_b`` columns of ``[0, T)``
and ``mask[b]`` marks them. Buffers grow by doubling, so a decode step writes one column in
place instead of concatenating the cache.

Decode steps of Llama-style text models go through ``decode.FastDecoder`` (checked once
against the HF forward), attending per block of ``segment_rows`` rows from the block's
first non-padding column; rows are re-sorted by start when that pays. Identical prompts
admitted together are prefilled once, and recent prompts' prefill results are kept in an
LRU (emptied by any command) for samples of the same prompt admitted later.

Logprob convention: ``output_logprobs[i]`` is ``log_softmax(logits / temperature)`` of the
sampled token when sampling (before top-k/top-p truncation and before the min-new-tokens
stop masking, i.e. what a trainer recomputes from the model), and ``log_softmax(logits)``
(temperature 1) under greedy decoding.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from areal.utils import logging

logger = logging.getLogger("LocalGenerationCore")

_INF = float("inf")
# Temperatures below this are treated as greedy decoding (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5


class RequestError(ValueError):
    """A request the core refuses (maps to HTTP 400)."""


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    greedy: bool = False
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    # Per-request sampling seed: the same seed gives the same tokens whatever else is in
    # the batch (a resumed run regenerates exactly what the crashed one would have).
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise RequestError(
                f"unknown sampling parameter(s) {sorted(unknown)}; allowed: {sorted(known)}"
            )
        try:
            sp = cls(**d)
            sp.max_new_tokens = int(sp.max_new_tokens)
            sp.min_new_tokens = int(sp.min_new_tokens)
            sp.temperature = float(sp.temperature)
            sp.top_p = float(sp.top_p)
            sp.top_k = int(sp.top_k) if sp.top_k is not None else -1
            sp.greedy = bool(sp.greedy)
            sp.ignore_eos = bool(sp.ignore_eos)
            sp.stop_token_ids = [int(t) for t in (sp.stop_token_ids or [])]
            sp.seed = None if sp.seed is None else int(sp.seed)
        except (TypeError, ValueError) as e:
            raise RequestError(f"bad sampling parameters: {e}") from e
        sp.validate()
        return sp

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens={self.max_new_tokens}; must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens={self.min_new_tokens}; must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(
                f"temperature={self.temperature}; must be a finite number >= 0 (0 = greedy)"
            )
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            # As vLLM: a temperature this small is greedy decoding (dividing the logits by
            # it would overflow to inf and give NaN logprobs).
            self.greedy = True
            self.temperature = 1.0
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p}; must be in (0, 1]")


@dataclasses.dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    callback: Callable[[dict[str, Any]], None]
    stop_set: frozenset[int]
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_versions: list[int] = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    abort_requested: bool = False
    done: bool = False
    generator: torch.Generator | None = None
    finish: str = ""
    device: torch.device | str = "cpu"  # where the per-request sampling generator lives
    # Vision-language models: {"pixel_values", "image_grid_thw"} of the prompt's images.
    mm: dict[str, Any] | None = None
    plain: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if self.params.seed is not None and not self.params.greedy:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(self.params.seed % (2**63))
        p = self.params
        # Plain sampling (no seed, no top-k/top-p truncation): the whole batch is sampled
        # with a few tensor ops when every row is plain (see ``_sample``).
        self.plain = not p.greedy and self.generator is None and p.top_k <= 0 and p.top_p >= 1.0


class _BufferLayer(DynamicLayer):
    """A cache layer writing into a preallocated buffer (views of ``[:, :, :length]``)."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.length = kbuf, vbuf, length
        self.device = kbuf.device
        self.dtype = kbuf.dtype
        self.is_initialized = True
        self.keys = kbuf[:, :, :length]
        self.values = vbuf[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.kbuf[:, :, self.length : end] = key_states
        self.vbuf[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self.kbuf[:, :, :end]
        self.values = self.vbuf[:, :, :end]
        return self.keys, self.values


class _PromptSlots:
    """Prompt keys/values stored once per distinct running prompt (shared-prompt decoding).

    Slot ``s`` holds one prompt's cache in columns ``[0, lens[s])`` of per-layer buffers
    ``[slots, kv, P, D]``; every row of the running batch points to its prompt's slot
    (``_Batch.pid``), so the n samples of a prompt read its cache once per step. A slot is
    free again when its last row leaves. ``by_prompt`` finds a prompt's live slot; it is
    emptied when a command runs (the weights may change: running rows keep their slots,
    new requests prefill again).
    """

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.bias: torch.Tensor | None = None  # [slots, P]: 0 in a prompt, dtype min after
        self.lens: list[int] = []  # 0 = free slot
        self.refs: list[int] = []
        self.logits: list[torch.Tensor | None] = []  # the prompt's last logits
        self.prompt_of: list[tuple[int, ...] | None] = []
        self.by_prompt: dict[tuple[int, ...], int] = {}

    def add(
        self,
        prompt: tuple[int, ...],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        logits: torch.Tensor,
    ) -> int:
        """Store one prompt's cache (per layer ``[kv, L, D]``); returns its slot."""
        L = keys[0].shape[1]
        if not self.keys:
            self.keys = [k.new_zeros(8, k.shape[0], max(L, 64), k.shape[2]) for k in keys]
            self.values = [torch.zeros_like(k) for k in self.keys]
            self.bias = keys[0].new_zeros(8, self.keys[0].shape[2])
            self.lens, self.refs = [0] * 8, [0] * 8
            self.logits, self.prompt_of = [None] * 8, [None] * 8
        slot = next((i for i, n in enumerate(self.lens) if n == 0), len(self.lens))
        n_slots, cap = self.keys[0].shape[0], self.keys[0].shape[2]
        if slot >= n_slots or L > cap:
            grow_s = 2 * n_slots if slot >= n_slots else n_slots
            grow_p = max(L, 2 * cap) if L > cap else cap
            for bufs in (self.keys, self.values):
                for i, old in enumerate(bufs):
                    buf = old.new_zeros(grow_s, old.shape[1], grow_p, old.shape[3])
                    buf[:n_slots, :, :cap] = old
                    bufs[i] = buf
            bias = self.bias.new_zeros(grow_s, grow_p)
            bias[:n_slots, :cap] = self.bias
            bias[:n_slots, cap:] = torch.finfo(bias.dtype).min
            self.bias = bias
            extra = grow_s - n_slots
            self.lens += [0] * extra
            self.refs += [0] * extra
            self.logits += [None] * extra
            self.prompt_of += [None] * extra
        for bufs, new in ((self.keys, keys), (self.values, values)):
            for buf, t in zip(bufs, new):
                buf[slot, :, :L] = t
        self.bias[slot, :L] = 0.0
        self.bias[slot, L:] = torch.finfo(self.bias.dtype).min
        self.lens[slot], self.refs[slot] = L, 0
        self.logits[slot], self.prompt_of[slot] = logits, prompt
        self.by_prompt[prompt] = slot
        return slot

    def reorder(self, order: list[int]) -> list[int]:
        """Permute the slots (``order``: old slot of each new slot, all slots); returns the
        new slot of every old one."""
        idx = torch.tensor(order, dtype=torch.long, device=self.bias.device)
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                bufs[i] = buf.index_select(0, idx)
        self.bias = self.bias.index_select(0, idx)
        self.lens = [self.lens[i] for i in order]
        self.refs = [self.refs[i] for i in order]
        self.logits = [self.logits[i] for i in order]
        self.prompt_of = [self.prompt_of[i] for i in order]
        new_of_old = [0] * len(order)
        for new, old in enumerate(order):
            new_of_old[old] = new
        self.by_prompt = {k: new_of_old[v] for k, v in self.by_prompt.items()}
        return new_of_old

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] <= 0:
            self.refs[slot] = self.lens[slot] = 0
            self.logits[slot] = None
            if self.by_prompt.get(self.prompt_of[slot]) == slot:
                del self.by_prompt[self.prompt_of[slot]]
            self.prompt_of[slot] = None


def _slot_chunks(lens: list[int], max_chunks: int = 4) -> list[tuple[int, int, int]]:
    """``(first_slot, end_slot, columns)`` ranges covering slots ``[0, len(lens))``: a new
    range starts where a prompt is shorter than 0.6x the longest of the current one, so
    slots sorted by length are attended with little padding (free slots, length 0, join
    the current range)."""
    chunks: list[tuple[int, int, int]] = []
    s0 = top = 0
    for s, n in enumerate(lens):
        if n and top and n < 0.6 * top and s - s0 >= 2 and len(chunks) < max_chunks - 1:
            chunks.append((s0, s, top))
            s0, top = s, n
        else:
            top = max(top, n)
    chunks.append((s0, len(lens), max(top, 1)))
    return chunks


def _chunks_cost(chunks: list[tuple[int, int, int]]) -> int:
    return sum((s1 - s0) * n for s0, s1, n in chunks)


class _Batch:
    """Running requests, their left-padded KV buffers, mask and next input token.

    Finished requests free their row (``reqs[i] = None``, mask zeroed) instead of forcing
    a copy of the whole cache; new requests reuse free rows. Rows are compacted only when
    many are free, and leading columns that are padding for every live row are trimmed
    before the buffers would grow.

    With ``shared=True`` (fast decode of text models) a row's buffers hold only its
    generated tokens; its prompt's keys/values sit once in ``slots`` (row ``i`` uses slot
    ``pid[i]``, -1 for a free row).
    """

    def __init__(self, shared: bool = False):
        self.shared = shared
        self.slots = _PromptSlots() if shared else None
        self.pid: list[int] = []
        self._prefix = None  # the decode step's SharedPrefix, rebuilt when rows change
        self.reqs: list[_Request | None] = []
        self.kbufs: list[torch.Tensor] = []
        self.vbufs: list[torch.Tensor] = []
        self.T = 0
        self.mask: torch.Tensor | None = None  # [rows, T] long
        self.next_pos: torch.Tensor | None = None  # [rows] position of the next input token
        self.next_tok: torch.Tensor | None = None  # [rows]

    def __len__(self) -> int:
        return sum(r is not None for r in self.reqs)

    @property
    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.reqs) if r is not None]

    def _reshape(self, rows: list[int], start: int, cap: int, left_pad: int = 0) -> None:
        """Rebuild buffers keeping ``rows`` and columns ``[start, T)`` (+ ``left_pad`` zeros)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        T = self.T - start + left_pad
        cap = max(cap, T + 1)
        for bufs in (self.kbufs, self.vbufs):
            for i, old in enumerate(bufs):
                buf = old.new_zeros(len(rows), old.shape[1], cap, old.shape[3])
                buf[:, :, left_pad:T] = old[:, :, start : self.T].index_select(0, idx)
                bufs[i] = buf
        mask = torch.zeros(len(rows), T, dtype=torch.long, device=self.mask.device)
        mask[:, left_pad:] = self.mask.index_select(0, idx)[:, start:]
        self.mask = mask
        self.T = T
        self.reqs = [self.reqs[i] for i in rows]
        if self.shared:
            self.pid = [self.pid[i] for i in rows]
            self._prefix = None
        self.next_pos = self.next_pos.index_select(0, idx)
        self.next_tok = self.next_tok.index_select(0, idx)

    def _lead(self) -> int:
        """Leading columns that are padding for every row."""
        nz = self.mask.any(dim=0).nonzero()
        return int(nz[0]) if len(nz) else self.T

    def ensure_capacity(self, extra: int = 1) -> None:
        cap = self.kbufs[0].shape[2]
        if self.T + extra <= cap:
            return
        every = list(range(len(self.reqs)))
        lead = self._lead()
        if lead >= max(16, self.T // 4):
            self._reshape(every, lead, cap)
            if self.T + extra <= self.kbufs[0].shape[2]:
                return
        self._reshape(every, 0, max(self.T + extra, 2 * cap))

    def row_starts(self) -> list[int]:
        """First cache column of every row (``T`` for free rows)."""
        if not self.reqs:
            return []
        if self.T == 0:
            return (
                [0 if r is not None else 1 for r in self.reqs]
                if self.shared
                else [0] * len(self.reqs)
            )
        has = self.mask.any(dim=1)
        first = torch.where(
            has, self.mask.argmax(dim=1), torch.full_like(has, self.T, dtype=torch.long)
        ).tolist()
        if self.shared:  # a live row attends at least to the new column T; free rows: T + 1
            first = [s if r is not None else self.T + 1 for s, r in zip(first, self.reqs)]
        return first

    def segments(self, starts: list[int], rows_per_segment: int) -> list[tuple[int, int, int]]:
        """``(row_start, row_end, first_column)`` blocks for the fast decode step; blocks of
        free rows only are left out (their rows' outputs are never read)."""
        out = []
        for r0 in range(0, len(starts), rows_per_segment):
            r1 = min(r0 + rows_per_segment, len(starts))
            c0 = min(starts[r0:r1])
            if c0 < self.T or (self.shared and c0 == self.T):
                out.append((r0, r1, c0))
        return out

    def sort_rows(self, starts: list[int], rows_per_segment: int) -> bool:
        """Reorder rows by first column (free rows last) when that cuts the attention work
        of segmented decoding by more than the copy costs over a few steps."""
        R = len(starts)
        if R <= rows_per_segment:
            return False

        def cost(st: list[int]) -> int:
            total = 0
            for r0 in range(0, R, rows_per_segment):
                c0 = min(st[r0 : r0 + rows_per_segment])
                if c0 < self.T:
                    total += min(rows_per_segment, R - r0) * (self.T - c0)
            return total

        order = sorted(range(R), key=lambda i: starts[i])
        gain = cost(starts) - cost([starts[i] for i in order])
        if gain * 16 < R * self.T:  # a sort copies the whole cache once
            return False
        lead = min(min(starts), self.T)
        self._reshape(order, lead, self.kbufs[0].shape[2])
        return True

    def release(self, rows: list[int], eager: bool = False) -> None:
        """Free ``rows``; compact when half the rows are free (``eager``, nothing waiting to
        refill them: an eighth)."""
        for i in rows:
            self.reqs[i] = None
            if self.shared:
                self.slots.release(self.pid[i])
                self.pid[i] = -1
        self._prefix = None
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask[idx] = 0
        self.next_tok[idx] = 0
        self.next_pos[idx] = 0
        live = self.live
        if not live:
            self.__init__(self.shared)
        elif len(self.reqs) - len(live) >= (
            max(4, len(self.reqs) // 8) if eager else max(8, len(self.reqs) // 2)
        ):
            live_idx = torch.tensor(live, device=self.mask.device)
            lead = self.mask.index_select(0, live_idx).any(dim=0).nonzero()
            start = int(lead[0]) if len(lead) else self.T
            self._reshape(live, start, self.T - start + 64)

    def merge(
        self,
        reqs: list[_Request],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        next_tok: torch.Tensor,
        pids: list[int] | None = None,
    ) -> None:
        """Add prefilled rows (their cache ``[n, H, P, D]`` left-padded like ``mask``;
        shared layout: ``P == 0`` and ``pids`` their prompts' slots)."""
        P = mask.shape[1]
        n = len(reqs)
        pids = list(pids) if pids is not None else [-1] * n
        self._prefix = None
        if not self.reqs:
            cap = P + 64
            self.kbufs, self.vbufs = [], []
            for k, v in zip(keys, values):
                kb = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
                vb = v.new_zeros(kb.shape)
                kb[:, :, :P] = k
                vb[:, :, :P] = v
                self.kbufs.append(kb)
                self.vbufs.append(vb)
            self.reqs = list(reqs)
            self.pid = pids if self.shared else []
            self.T, self.mask, self.next_pos, self.next_tok = P, mask, next_pos, next_tok
            return
        # Free rows from the end: after ``sort_rows`` the youngest rows sit there.
        free = [i for i in range(len(self.reqs) - 1, -1, -1) if self.reqs[i] is None]
        if P <= self.T and free:
            # Write into free rows in place: columns [T - P, T).
            k_fill = min(len(free), n)
            rows = torch.tensor(free[:k_fill], dtype=torch.long, device=self.mask.device)
            T = self.T
            for bufs, new_rows in ((self.kbufs, keys), (self.vbufs, values)):
                for i, buf in enumerate(bufs):
                    buf[rows] = 0
                    buf[rows, :, T - P : T] = new_rows[i][:k_fill]
            self.mask[rows] = 0
            self.mask[rows, T - P :] = mask[:k_fill]
            self.next_pos[rows] = next_pos[:k_fill]
            self.next_tok[rows] = next_tok[:k_fill]
            for j, r in enumerate(free[:k_fill]):
                self.reqs[r] = reqs[j]
                if self.shared:
                    self.pid[r] = pids[j]
            if k_fill == n:
                return
            reqs, mask, pids = reqs[k_fill:], mask[k_fill:], pids[k_fill:]
            keys = [k[k_fill:] for k in keys]
            values = [v[k_fill:] for v in values]
            next_pos, next_tok = next_pos[k_fill:], next_tok[k_fill:]
            n = len(reqs)
        # Append rows (left-padding the running rows when the new prompts are longer).
        live = self.live
        extra = max(0, P - self.T)
        if extra or len(live) < len(self.reqs):
            self._reshape(live, 0, self.kbufs[0].shape[2] + extra, left_pad=extra)
        B, T = len(self.reqs), self.T
        cap = self.kbufs[0].shape[2]
        for bufs, new_rows in ((self.kbufs, keys), (self.vbufs, values)):
            for i, old in enumerate(bufs):
                buf = old.new_zeros(B + n, old.shape[1], cap, old.shape[3])
                buf[:B, :, :T] = old[:, :, :T]
                buf[B:, :, T - P : T] = new_rows[i]
                bufs[i] = buf
        m = torch.zeros(B + n, T, dtype=torch.long, device=self.mask.device)
        m[:B] = self.mask
        m[B:, T - P :] = mask
        self.mask = m
        self.reqs.extend(reqs)
        if self.shared:
            self.pid.extend(pids)
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.next_tok = torch.cat([self.next_tok, next_tok])

    def prefix(self, n_kv: int):
        """The decode step's view of the prompt slots (``decode.SharedPrefix``)."""
        if self._prefix is not None:
            return self._prefix
        from areal.engine.local_server.decode import SharedPrefix

        dev = self.mask.device
        rows = [i for i, p in enumerate(self.pid) if p >= 0]
        pids = [self.pid[i] for i in rows]
        count: dict[int, int] = {}
        member = []
        for p in pids:
            m = count.get(p, 0)
            member.append(m)
            count[p] = m + 1
        S = max(pids) + 1
        M = max(count.values())
        heads = torch.arange(n_kv, device=dev)
        rr = torch.tensor(rows, dtype=torch.long, device=dev).unsqueeze(1) * n_kv + heads
        pp = torch.tensor(pids, dtype=torch.long, device=dev).unsqueeze(1)
        mm = torch.tensor(member, dtype=torch.long, device=dev).unsqueeze(1)
        places = ((pp * n_kv + heads) * M + mm).flatten()
        gather = torch.zeros(S * n_kv * M, dtype=torch.long, device=dev)
        gather[places] = rr.flatten()
        scatter = torch.zeros(len(self.reqs) * n_kv, dtype=torch.long, device=dev)
        scatter[rr.flatten()] = places
        self._prefix = SharedPrefix(
            keys=self.slots.keys,
            values=self.slots.values,
            bias=self.slots.bias,
            gather=gather,
            scatter=scatter,
            rows_per_slot=M,
            chunks=_slot_chunks(self.slots.lens[:S]),
        )
        return self._prefix

    def sort_slots(self) -> bool:
        """Reorder the prompt slots longest first when that cuts the padded prompt columns
        the decode step attends to by more than 15% (a sort copies the prompt caches)."""
        lens = self.slots.lens
        live = [s for s, n in enumerate(lens) if n]
        if len(live) < 3:
            return False
        S = live[-1] + 1
        order = sorted(live, key=lambda s: -lens[s])
        now = _chunks_cost(_slot_chunks(lens[:S]))
        if _chunks_cost(_slot_chunks([lens[s] for s in order])) > 0.85 * now:
            return False
        live_set = set(live)
        order += [s for s in range(len(lens)) if s not in live_set]
        new_of_old = self.slots.reorder(order)
        self.pid = [new_of_old[p] if p >= 0 else -1 for p in self.pid]
        self._prefix = None
        return True

    def unshared(self) -> _Batch:
        """The same rows in the plain layout (each row's prompt columns, then its own)."""
        full = _Batch()
        lens = [self.slots.lens[p] if p >= 0 else 0 for p in self.pid]
        P = max(lens, default=0)
        B, T = len(self.reqs), self.T
        mask = torch.zeros(B, P + T, dtype=torch.long, device=self.mask.device)
        mask[:, P:] = self.mask
        for r, L in enumerate(lens):
            mask[r, P - L : P] = 1
        for dst, own, shared in (
            (full.kbufs, self.kbufs, self.slots.keys),
            (full.vbufs, self.vbufs, self.slots.values),
        ):
            for o, sh in zip(own, shared):
                buf = o.new_zeros(B, o.shape[1], P + T + 64, o.shape[3])
                buf[:, :, P : P + T] = o[:, :, :T]
                for r, (p, L) in enumerate(zip(self.pid, lens)):
                    if L:
                        buf[r, :, P - L : P] = sh[p, :, :L]
                dst.append(buf)
        full.reqs = list(self.reqs)
        full.T, full.mask = P + T, mask
        full.next_pos, full.next_tok = self.next_pos.clone(), self.next_tok.clone()
        return full

    def cache(self) -> DynamicCache:
        cache = DynamicCache()
        cache.layer_class_to_replicate = None
        cache.layers = [_BufferLayer(k, v, self.T) for k, v in zip(self.kbufs, self.vbufs)]
        return cache


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (rows need not be normalised) by inverse CDF: one
    uniform number per row (``torch.multinomial`` draws one per vocabulary entry on CPU,
    ~15x slower here)."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _sample(
    logits: torch.Tensor, reqs: list[_Request], gen_counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens [B], logprobs [B]) per the module convention."""
    logits = logits.float()
    B, V = logits.shape
    dev = logits.device
    if all(r.plain for r in reqs) and not any(
        r.params.min_new_tokens > c and r.stop_set for r, c in zip(reqs, gen_counts)
    ):
        temps = [r.params.temperature for r in reqs]
        scaled = logits
        if any(t != 1.0 for t in temps):
            scaled = logits / torch.tensor(temps, device=dev).unsqueeze(1)
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = _draw(logp.exp())
        return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    greedy = torch.tensor([r.params.greedy for r in reqs], device=dev)
    temps = torch.tensor(
        [1.0 if r.params.greedy else r.params.temperature for r in reqs], device=dev
    )
    scaled = logits / temps.unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    # Stop tokens are not allowed before min_new_tokens.
    masked = None
    for b, r in enumerate(reqs):
        if r.params.min_new_tokens > gen_counts[b] and r.stop_set:
            if masked is None:
                masked = scaled.clone()
            masked[b, list(r.stop_set)] = -_INF
    work = scaled if masked is None else masked
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    if bool(greedy.any()):
        tokens[greedy] = work[greedy].argmax(dim=-1)
    samp = ~greedy
    if bool(samp.any()):
        s_logits = work[samp]
        s_reqs = [r for r, g in zip(reqs, greedy.tolist()) if not g]
        top_k = torch.tensor(
            [r.params.top_k if 0 < r.params.top_k < V else V for r in s_reqs], device=dev
        )
        top_p = torch.tensor([r.params.top_p for r in s_reqs], device=dev)
        if bool((top_k < V).any()) or bool((top_p < 1).any()):
            sorted_logits, sorted_idx = torch.sort(s_logits, dim=-1, descending=True)
            ranks = torch.arange(V, device=dev).unsqueeze(0)
            remove = ranks >= top_k.unsqueeze(1)
            probs = torch.softmax(sorted_logits.masked_fill(remove, -_INF), dim=-1)
            cum = probs.cumsum(dim=-1) - probs  # mass strictly before this token
            remove = remove | (cum >= top_p.unsqueeze(1))
            remove[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(remove, -_INF)
            s_logits = torch.full_like(s_logits, -_INF).scatter(1, sorted_idx, sorted_logits)
        probs = torch.softmax(s_logits, dim=-1)
        drawn = torch.empty(len(s_reqs), dtype=torch.long, device=dev)
        seeded = [i for i, r in enumerate(s_reqs) if r.generator is not None]
        unseeded = [i for i, r in enumerate(s_reqs) if r.generator is None]
        if unseeded:
            drawn[unseeded] = _draw(probs[unseeded])
        for i in seeded:  # one draw per seeded request from its own generator
            drawn[i] = torch.multinomial(probs[i], 1, generator=s_reqs[i].generator)[0]
        tokens[samp] = drawn
    token_logp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, token_logp


class GenerationCore:
    """Owns the model and the scheduler thread. Thread-safe public methods."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch_size: int = 128,
        max_prefill_tokens: int = 4096,
        eos_token_ids: list[int] | None = None,
        context_length: int | None = None,
        version: int = 0,
        fast_decode: bool = True,
        segment_rows: int = 32,
        prompt_cache_mb: float = 64.0,
        shared_prompts: bool = True,
    ):
        self.model = model.eval()
        # Decode steps skip the HF forward's per-step machinery for known decoder-only
        # structures (areal.engine.local_server.decode); checked once against the forward.
        self._fast = None
        if fast_decode:
            from areal.engine.local_server.decode import FastDecoder

            self._fast = FastDecoder.build(model)
        self._fast_checked = False
        # Fast decode attends per block of ``segment_rows`` rows from the block's first
        # non-padding column; rows are re-sorted by start every few steps when that pays.
        self.segment_rows = max(1, int(segment_rows))
        self._since_sort = 0
        # Recent prompts' prefill results (text only), emptied whenever a command runs.
        self.prompt_cache_bytes = int(prompt_cache_mb * 2**20)
        self._prompt_cache: collections.OrderedDict = collections.OrderedDict()
        self._prompt_cache_used = 0
        # Where the model lives (CPU, or a CUDA device): every batch tensor is put there.
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        cfg = model.config
        if eos_token_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            if eos is None:
                eos = getattr(cfg, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = list(eos_token_ids)
        self.context_length = (
            context_length or getattr(cfg, "max_position_embeddings", None) or 1 << 30
        )
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or cfg.get_text_config().vocab_size)
        # Qwen2-VL family: image prefill with M-RoPE positions (areal.engine.local_server.vision)
        self.is_vlm = getattr(cfg, "model_type", None) in ("qwen2_vl", "qwen2_5_vl")
        # Fast decode keeps each distinct prompt's cache once, shared by its samples.
        self._shared = bool(shared_prompts) and self._fast is not None and not self.is_vlm
        self.version = version
        self.paused = False

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._batch = _Batch(self._shared)
        self._stopped = False
        self._rids: dict[str, _Request] = {}
        # metrics
        self._generated_total = 0
        self._finished_total = 0
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()
        self._thread = threading.Thread(target=self._loop, name="generation-core", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        callback: Callable[[dict[str, Any]], None],
        mm_inputs: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request; ``callback(result)`` runs on the scheduler thread when it ends.

        ``mm_inputs`` (vision-language models): ``pixel_values`` and ``image_grid_thw`` of
        the images whose expanded ``<|image_pad|>`` tokens ``input_ids`` holds.
        """
        if not input_ids:
            raise RequestError("input_ids is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in input_ids):
            raise RequestError(f"input_ids must be integers in [0, vocab_size={self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise RequestError(
                f"prompt has {len(input_ids)} tokens; the model's context length is "
                f"{self.context_length} (prompt + at least one generated token must fit)"
            )
        params = dataclasses.replace(params)
        params.max_new_tokens = min(params.max_new_tokens, self.context_length - len(input_ids))
        params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        if mm_inputs is not None:
            from areal.engine.local_server.vision import check_mm_request

            check_mm_request(self.model, input_ids, mm_inputs, self.is_vlm)
        req = _Request(rid, list(input_ids), params, callback, frozenset(stop), device=self.device)
        req.mm = mm_inputs
        with self._lock:
            if self._stopped:
                raise RuntimeError("generation core is shut down")
            old = self._rids.get(rid)
            if old is not None:  # a client retry: the older attempt is aborted
                old.abort_requested = True
            self._rids[rid] = req
            self._waiting.append(req)
            self._wakeup.notify()

    def abort(self, rid: str) -> bool:
        with self._lock:
            req = self._rids.get(rid)
            if req is None:
                return False
            req.abort_requested = True
            self._wakeup.notify()
        return True

    def run_command(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between two steps."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        with self._lock:
            self._wakeup.notify()
        return fut

    def pause(self) -> Future:
        """Abort in-flight requests (they return with stop reason ``abort``); hold new ones."""

        def _do():
            self.paused = True
            self._finish_rows(self._batch.live, "abort")

        return self.run_command(_do)

    def resume(self) -> Future:
        def _do():
            self.paused = False

        return self.run_command(_do)

    def metrics(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            while self._token_times and self._token_times[0][0] < now - 10.0:
                self._token_times.popleft()
            recent = sum(n for _, n in self._token_times)
            span = (now - self._token_times[0][0]) if self._token_times else 0.0
            return {
                "num_requests_running": len(self._batch),
                "num_requests_waiting": len(self._waiting),
                "generated_tokens_total": self._generated_total,
                "finished_requests_total": self._finished_total,
                "generation_tokens_per_s": recent / max(span, 1.0) if recent else 0.0,
                "version": self.version,
                "paused": self.paused,
                "device": str(self.device),
            }

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        # Inference mode (not just no-grad): no autograd bookkeeping on any op of the
        # scheduler thread, ~5% of a decode step at small model sizes. In-place weight
        # updates from commands are allowed in it.
        with torch.inference_mode():
            self._serve()
        self._fail_all("server shutting down")

    def _serve(self) -> None:
        while True:
            with self._lock:
                while (
                    not self._stopped
                    and self._commands.empty()
                    and not any(r is not None and r.abort_requested for r in self._batch.reqs)
                    and not any(r.abort_requested for r in self._waiting)
                    and (self.paused or (not self._waiting and not len(self._batch)))
                ):
                    self._wakeup.wait(timeout=1.0)
                if self._stopped:
                    break
            try:
                self._run_commands()
                self._handle_aborts()
                if self.paused:
                    continue
                self._admit()
                if len(self._batch):
                    self._decode_step()
            except Exception as e:  # keep serving: fail the affected requests
                logger.exception("generation step failed: %s", e)
                self._fail_all(f"internal error: {e}")

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            self._prompt_cache.clear()  # a command may change the weights
            self._prompt_cache_used = 0
            if self._batch.slots is not None:
                self._batch.slots.by_prompt.clear()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _handle_aborts(self) -> None:
        rows = [i for i, r in enumerate(self._batch.reqs) if r is not None and r.abort_requested]
        if rows:
            self._finish_rows(rows, "abort")
        with self._lock:
            dropped = [r for r in self._waiting if r.abort_requested]
            if dropped:
                self._waiting = collections.deque(r for r in self._waiting if not r.abort_requested)
        for r in dropped:
            self._deliver(r, "abort")

    def _admit(self) -> None:
        new: list[_Request] = []
        with self._lock:
            budget = self.max_prefill_tokens
            seen: set[tuple[int, ...]] = set()
            while self._waiting and len(self._batch) + len(new) < self.max_batch_size:
                r = self._waiting[0]
                key = tuple(r.input_ids) if r.mm is None else None
                cost = 0 if key in seen else len(r.input_ids)  # repeats are prefilled once
                if new and budget - cost < 0:
                    break
                budget -= cost
                if key is not None:
                    seen.add(key)
                new.append(self._waiting.popleft())
        if not new:
            return
        if self._batch.shared:
            self._admit_shared(new)
            return
        # Identical prompts (n samples of one prompt) are prefilled once and their cache
        # rows copied: the same computation, done once.
        slot: dict[Any, int] = {}
        uniq: list[_Request] = []
        inverse: list[int] = []
        for r in new:
            key = tuple(r.input_ids) if r.mm is None else id(r)
            j = slot.get(key)
            if j is None:
                j = slot[key] = len(uniq)
                uniq.append(r)
            inverse.append(j)
        if self.is_vlm or self.prompt_cache_bytes <= 0:
            keys, values, logits, mask, next_pos = self._prefill(uniq)
        else:
            keys, values, logits, mask, next_pos = self._prefill_cached(uniq)
        if len(uniq) < len(new):
            inv = torch.tensor(inverse, dtype=torch.long, device=self.device)
            keys = [k.index_select(0, inv) for k in keys]
            values = [v.index_select(0, inv) for v in values]
            logits, mask, next_pos = logits[inv], mask[inv], next_pos[inv]
        tokens, logps = _sample(logits, new, [0] * len(new))
        self._record(new, tokens, logps)
        self._batch.merge(new, keys, values, mask, next_pos, tokens)
        self._finish_done()

    def _admit_shared(self, new: list[_Request]) -> None:
        """Admission in the shared layout: a prompt already running (or in the LRU) is not
        prefilled again; new rows point to their prompt's slot and start with no columns."""
        slots = self._batch.slots
        keyed = [tuple(r.input_ids) for r in new]
        missing: dict[tuple[int, ...], _Request] = {}
        for k, r in zip(keyed, new):
            if k not in slots.by_prompt and k not in missing:
                missing[k] = r
        if missing:
            uniq = list(missing.values())
            if self.prompt_cache_bytes > 0:
                keys, values, logits, mask, _ = self._prefill_cached(uniq)
            else:
                keys, values, logits, mask, _ = self._prefill(uniq)
            P = mask.shape[1]
            for j, (k, r) in enumerate(missing.items()):
                L = len(r.input_ids)
                slots.add(
                    k,
                    [t[j, :, P - L :] for t in keys],
                    [t[j, :, P - L :] for t in values],
                    logits[j],
                )
        pids = [slots.by_prompt[k] for k in keyed]
        for p in pids:
            slots.refs[p] += 1
        logits = torch.stack([slots.logits[p] for p in pids])
        tokens, logps = _sample(logits, new, [0] * len(new))
        self._record(new, tokens, logps)
        n, kv, D = len(new), self._fast.n_kv, self._fast.head_dim
        dt = logits.dtype if not slots.keys else slots.keys[0].dtype
        empty = [torch.zeros(n, kv, 0, D, dtype=dt, device=self.device)] * len(self._fast.layers)
        next_pos = torch.tensor([len(r.input_ids) for r in new], device=self.device)
        mask = torch.zeros(n, 0, dtype=torch.long, device=self.device)
        self._batch.merge(new, empty, empty, mask, next_pos, tokens, pids)
        self._finish_done()

    def _prefill_cached(self, uniq: list[_Request]):
        """``_prefill`` for text prompts through an LRU of recent prompts' cache columns and
        last logits (the n samples of a prompt often arrive in different admissions). The
        LRU is emptied whenever a command runs (weights may have changed)."""
        pc = self._prompt_cache
        keyed = [tuple(r.input_ids) for r in uniq]
        for k in keyed:
            if k in pc:
                pc.move_to_end(k)  # the entries used now are the newest: never evicted below
        misses = [r for r, k in zip(uniq, keyed) if k not in pc]
        # Prompts of one length are prefilled together, others apart: no padding (on CPU a
        # padded batch of different lengths costs ~1.5x the separate prefills).
        same_len: dict[int, list[_Request]] = {}
        for r in misses:
            same_len.setdefault(len(r.input_ids), []).append(r)
        for group in same_len.values():
            keys, values, logits, _, _ = self._prefill(group)
            for i, r in enumerate(group):
                entry = (
                    [k[i].clone() for k in keys],
                    [v[i].clone() for v in values],
                    logits[i].clone(),
                )
                nbytes = sum(t.numel() * t.element_size() for t in entry[0] + entry[1])
                pc[tuple(r.input_ids)] = entry
                self._prompt_cache_used += nbytes
        if misses:
            while self._prompt_cache_used > self.prompt_cache_bytes and len(pc) > len(uniq):
                _, (ks, vs, _) = pc.popitem(last=False)
                self._prompt_cache_used -= sum(t.numel() * t.element_size() for t in ks + vs)
        entries = [pc[k] for k in keyed]
        n = len(uniq)
        P = max(len(k) for k in keyed)
        keys, values = [], []
        for layer in range(len(entries[0][0])):
            for dst, part in ((keys, 0), (values, 1)):
                ref = entries[0][part][layer]
                buf = ref.new_zeros(n, ref.shape[0], P, ref.shape[2])
                for j, e in enumerate(entries):
                    t = e[part][layer]
                    buf[j, :, P - t.shape[1] :] = t
                dst.append(buf)
        logits = torch.stack([e[2] for e in entries])
        lens = torch.tensor([len(k) for k in keyed], device=self.device)
        mask = (torch.arange(P, device=self.device).unsqueeze(0) >= (P - lens).unsqueeze(1)).long()
        return keys, values, logits, mask, lens

    def _prefill(self, uniq: list[_Request]):
        """Left-padded prefill of ``uniq``: per-layer keys/values ``[n, kv, P, D]`` (zero at
        padding), last logits ``[n, V]``, mask ``[n, P]``, next positions ``[n]``."""
        P = max(len(r.input_ids) for r in uniq)
        n = len(uniq)
        ids = torch.zeros(n, P, dtype=torch.long)
        mask = torch.zeros(n, P, dtype=torch.long)
        for i, r in enumerate(uniq):
            L = len(r.input_ids)
            ids[i, P - L :] = torch.tensor(r.input_ids)
            mask[i, P - L :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        extra: dict[str, Any] = {"position_ids": pos}
        deltas = None
        if self.is_vlm:  # M-RoPE positions (+ pixel values of the rows that have images)
            from areal.engine.local_server.vision import prefill_mm_kwargs

            extra, deltas = prefill_mm_kwargs(self.model, uniq, ids, mask)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        pad = (mask == 0).view(n, 1, P, 1)
        keys = [layer.keys.masked_fill(pad, 0.0) for layer in cache.layers]
        values = [layer.values.masked_fill(pad, 0.0) for layer in cache.layers]
        logits = out.logits[:, -1, :]
        next_pos = mask.sum(-1)
        if deltas is not None:  # text after images continues from the largest M-RoPE position
            next_pos = next_pos + deltas
        return keys, values, logits, mask, next_pos

    def _decode_step(self) -> None:
        b = self._batch
        b.ensure_capacity(1)
        segments = None
        if self._fast is not None:
            starts = b.row_starts()
            self._since_sort += 1
            if self._since_sort >= 16:
                self._since_sort = 0
                if b.sort_rows(starts, self.segment_rows):
                    starts = b.row_starts()
                if b.shared:
                    b.sort_slots()
            segments = b.segments(starts, self.segment_rows)
        B = len(b.reqs)
        mask = torch.cat([b.mask, b.mask.new_ones(B, 1)], dim=1)
        if self._fast is not None:
            prefix = b.prefix(self._fast.n_kv) if b.shared else None
            logits = self._fast.step(
                b.next_tok, b.next_pos, b.kbufs, b.vbufs, b.T, mask, segments, prefix
            )
            if not self._fast_checked:  # once: the HF forward must agree (it rewrites column T)
                full, full_mask = b, mask
                if b.shared:  # the HF forward needs each row's whole cache
                    full = b.unshared()
                    full_mask = torch.cat([full.mask, full.mask.new_ones(B, 1)], dim=1)
                ref = self._hf_decode(full, full_mask)
                self._fast_checked = True
                rows = torch.tensor(b.live, dtype=torch.long, device=logits.device)
                if not self._fast.matches_reference(logits[rows], ref[rows]):  # free: any
                    self._fast = None
                    self._shared = False
                    self._batch = b = full
                    mask = full_mask
                    logits = ref
        else:
            logits = self._hf_decode(b, mask)
        b.mask = mask
        b.T += 1
        live = b.live
        reqs = [b.reqs[i] for i in live]
        if len(live) < B:
            idx = torch.tensor(live, dtype=torch.long, device=logits.device)
            logits = logits.index_select(0, idx)
        tokens, logps = _sample(logits, reqs, [len(r.output_ids) for r in reqs])
        if len(live) < B:
            b.next_pos[idx] += 1
            b.next_tok[idx] = tokens
        else:
            b.next_pos = b.next_pos + 1
            b.next_tok = tokens
        self._record(reqs, tokens, logps)
        self._finish_done()

    def _hf_decode(self, b: _Batch, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=b.next_tok.unsqueeze(1),
            attention_mask=mask,
            position_ids=b.next_pos.unsqueeze(1),
            cache=b.cache(),
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def _record(self, reqs: list[_Request], tokens: torch.Tensor, logps: torch.Tensor) -> None:
        now = time.monotonic()
        v = self.version
        for r, t, lp in zip(reqs, tokens.tolist(), logps.tolist()):
            if r.first_token_time is None:
                r.first_token_time = now
            r.output_ids.append(t)
            r.output_logprobs.append(lp)
            r.output_versions.append(v)
            n = len(r.output_ids)
            if n >= r.params.max_new_tokens:
                r.done = True
                r.finish = "length"
            elif t in r.stop_set and n >= r.params.min_new_tokens:
                r.done = True
                r.finish = "stop"
        with self._lock:
            self._generated_total += len(reqs)
            self._token_times.append((now, len(reqs)))

    def _finish_done(self) -> None:
        rows = [i for i, r in enumerate(self._batch.reqs) if r is not None and r.done]
        if rows:
            self._finish_rows(rows, None)

    def _finish_rows(self, rows: list[int], reason: str | None) -> None:
        if not rows:
            return
        finished = [self._batch.reqs[i] for i in rows]
        # Nothing waiting (the end of a burst): drop free rows sooner, they cost every step.
        self._batch.release(rows, eager=self._batch.shared and not self._waiting)
        for r in finished:
            self._deliver(r, reason or r.finish)

    def _deliver(self, r: _Request, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            if self._rids.get(r.rid) is r:
                del self._rids[r.rid]
            self._finished_total += 1
        result = {
            "rid": r.rid,
            "output_ids": r.output_ids,
            "output_logprobs": r.output_logprobs,
            "output_versions": r.output_versions,
            "finish_reason": reason,
            "prompt_tokens": len(r.input_ids),
            "ttft": (r.first_token_time - r.arrival) if r.first_token_time else None,
            "latency": now - r.arrival,
            "version": self.version,
        }
        try:
            r.callback(result)
        except Exception:
            logger.exception("result callback of %s failed", r.rid)

    def _fail_all(self, message: str) -> None:
        reqs = [r for r in self._batch.reqs if r is not None]
        self._batch = _Batch(self._shared)
        with self._lock:
            reqs.extend(self._waiting)
            self._waiting.clear()
        for r in reqs:
            with self._lock:
                if self._rids.get(r.rid) is r:
                    del self._rids[r.rid]
            try:
                r.callback({"rid": r.rid, "error": message})
            except Exception:
                logger.exception("result callback of %s failed", r.rid)
