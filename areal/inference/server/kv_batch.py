"""The running batch's KV cache of the built-in server (``KVBatch``).

The running batch keeps one KV buffer per layer shaped ``[B, kv_heads, capacity, head_dim]``
with left padding: row ``b`` holds its tokens in the last ``len_b`` columns of ``[0, T)``
and ``mask[b]`` marks them. Buffers grow by doubling, so a decode step writes one column in
place instead of concatenating the cache. ``BufferLayer`` is a transformers cache layer
writing into such a buffer; with ``shared=True`` (the fast decode of text models) prompts
live once in ``PromptSlots`` and rows hold only their generated tokens; ``slot_chunks`` /
``chunks_cost`` group rows into the blocks the decode step attends to.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from areal.inference.server.decode import SharedPrefix
from areal.inference.server.requests import Request

__all__ = ["BufferLayer", "KVBatch", "PromptSlots", "chunks_cost", "slot_chunks"]


class BufferLayer(DynamicLayer):
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


class PromptSlots:
    """Prompt keys/values stored once per distinct running prompt (shared-prompt decoding).

    Slot ``s`` holds one prompt's cache in columns ``[0, lens[s])`` of per-layer buffers
    ``[slots, kv, P, D]``; every row of the running batch points to its prompt's slot
    (``KVBatch.pid``), so the n samples of a prompt read its cache once per step. A slot is
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


def slot_chunks(lens: list[int], max_chunks: int = 4) -> list[tuple[int, int, int]]:
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


def chunks_cost(chunks: list[tuple[int, int, int]]) -> int:
    return sum((s1 - s0) * n for s0, s1, n in chunks)


class KVBatch:
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
        self.slots = PromptSlots() if shared else None
        self.pid: list[int] = []
        self._prefix = None  # the decode step's SharedPrefix, rebuilt when rows change
        self.reqs: list[Request | None] = []
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
        reqs: list[Request],
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
            chunks=slot_chunks(self.slots.lens[:S]),
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
        now = chunks_cost(slot_chunks(lens[:S]))
        if chunks_cost(slot_chunks([lens[s] for s in order])) > 0.85 * now:
            return False
        live_set = set(live)
        order += [s for s in range(len(lens)) if s not in live_set]
        new_of_old = self.slots.reorder(order)
        self.pid = [new_of_old[p] if p >= 0 else -1 for p in self.pid]
        self._prefix = None
        return True

    def unshared(self) -> KVBatch:
        """The same rows in the plain layout (each row's prompt columns, then its own)."""
        full = KVBatch()
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
        cache.layers = [BufferLayer(k, v, self.T) for k, v in zip(self.kbufs, self.vbufs)]
        return cache
