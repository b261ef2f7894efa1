"""Generation core of the built-in inference server: the scheduler of continuous batching.

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

Mixture-of-experts models: requests with ``return_routed_experts`` get, per token of
prompt + output (the last output token excepted: it is never fed), the experts each MoE
layer routed it to (``routing.RoutingRecorder``); the prompt LRU is off for them.

Logprob convention: ``output_logprobs[i]`` is ``log_softmax(logits / temperature)`` of the
sampled token when sampling (before top-k/top-p truncation and before the min-new-tokens
stop masking, i.e. what a trainer recomputes from the model), and ``log_softmax(logits)``
(temperature 1) under greedy decoding.

Where the parts live: request types and the error in ``requests``, the running batch's
KV cache in ``kv_batch``, sampling in ``sampling``, image requests in ``vision``; this
module is the scheduler (``GenerationCore``).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from areal.inference.server.decode import FastDecoder
from areal.inference.server.kv_batch import KVBatch
from areal.inference.server.requests import (
    GREEDY_TEMPERATURE_EPS,
    Request,
    RequestError,
    SamplingParams,
)
from areal.inference.server.routing import RoutingRecorder
from areal.inference.server.sampling import sample_tokens
from areal.inference.server.vision import check_mm_request, prefill_mm_kwargs
from areal.utils import logging

logger = logging.getLogger("LocalGenerationCore")

__all__ = ["GREEDY_TEMPERATURE_EPS", "GenerationCore", "RequestError", "SamplingParams"]


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
        # structures (areal.inference.server.decode); checked once against the forward.
        self._fast = None
        if fast_decode:
            self._fast = FastDecoder.build(model)
        self._fast_checked = False
        # MoE models: the experts of every token, for requests that ask (routing replay)
        self._routing = RoutingRecorder.attach(model)
        if self._routing is not None:
            prompt_cache_mb = 0.0
            self._fast = None  # decode through the HF forward, whose routers are hooked
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
        # Qwen2-VL family: image prefill with M-RoPE positions (areal.inference.server.vision)
        self.is_vlm = getattr(cfg, "model_type", None) in ("qwen2_vl", "qwen2_5_vl")
        # Fast decode keeps each distinct prompt's cache once, shared by its samples.
        self._shared = bool(shared_prompts) and self._fast is not None and not self.is_vlm
        self.version = version
        self.paused = False
        # torch threads of the scheduler thread (set_cpu_threads; the launch count first)
        self.cpu_threads = torch.get_num_threads()

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: collections.deque[Request] = collections.deque()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._batch = KVBatch(self._shared)
        self._stopped = False
        self._rids: dict[str, Request] = {}
        # Running greedy requests by ``Request.greedy_key``: an identical greedy request
        # admitted later follows the running one (no row of its own); emptied by commands.
        self._greedy_leaders: dict[tuple, Request] = {}
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
            check_mm_request(self.model, input_ids, mm_inputs, self.is_vlm)
        req = Request(rid, list(input_ids), params, callback, frozenset(stop))
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

    def set_cpu_threads(self, threads: int) -> Future:
        """torch threads of the scheduler thread (the one that runs the model); the
        future's result is the previous count."""

        def _do():
            previous = torch.get_num_threads()
            torch.set_num_threads(int(threads))
            self.cpu_threads = torch.get_num_threads()
            return previous

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
                "num_requests_running": len(self._batch)
                + sum(len(r.followers) for r in self._batch.reqs if r is not None),
                "num_requests_waiting": len(self._waiting),
                "generated_tokens_total": self._generated_total,
                "finished_requests_total": self._finished_total,
                "generation_tokens_per_s": recent / max(span, 1.0) if recent else 0.0,
                "version": self.version,
                "paused": self.paused,
                "device": str(self.device),
                "cpu_threads": self.cpu_threads,
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
            self._greedy_leaders.clear()  # later requests must not copy older tokens
            if self._batch.slots is not None:
                self._batch.slots.by_prompt.clear()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _handle_aborts(self) -> None:
        for i, r in enumerate(self._batch.reqs):
            if r is not None and r.followers:
                self._abort_followers(i, r)
        rows = [i for i, r in enumerate(self._batch.reqs) if r is not None and r.abort_requested]
        if rows:
            self._finish_rows(rows, "abort")
        with self._lock:
            dropped = [r for r in self._waiting if r.abort_requested]
            if dropped:
                self._waiting = collections.deque(r for r in self._waiting if not r.abort_requested)
        for r in dropped:
            self._deliver(r, "abort")

    def _abort_followers(self, row: int, lead: Request) -> None:
        """Deliver the aborted followers of ``lead`` (running in ``row``); an aborted
        leader with followers left hands its row to the first of them."""
        gone = [f for f in lead.followers if f.abort_requested]
        if gone:
            lead.followers = [f for f in lead.followers if not f.abort_requested]
            for f in gone:
                self._deliver(f, "abort")
        if lead.abort_requested and lead.followers:
            heir = lead.followers.pop(0)
            heir.followers, lead.followers = lead.followers, []
            self._batch.reqs[row] = heir
            key = lead.greedy_key()
            if self._greedy_leaders.get(key) is lead:
                self._greedy_leaders[key] = heir
            self._deliver(lead, "abort")

    def _follow(self, r: Request) -> bool:
        """Attach greedy request ``r`` to a running identical one (same prompt, limits and
        stop set: greedy decoding gives it the same tokens); returns whether it did."""
        key = r.greedy_key()
        if key is None:
            return False
        lead = self._greedy_leaders.get(key)
        if lead is None or lead is r or lead.done or lead.abort_requested:
            return False
        r.output_ids = list(lead.output_ids)
        r.output_logprobs = list(lead.output_logprobs)
        r.output_versions = list(lead.output_versions)
        if lead.output_ids:
            r.first_token_time = time.monotonic()
        lead.followers.append(r)
        return True

    def _admit(self) -> None:
        if self._admit_solo():
            return
        new: list[Request] = []
        with self._lock:
            budget = self.max_prefill_tokens
            seen: set[tuple[int, ...]] = set()
            while self._waiting:
                r = self._waiting[0]
                if r.params.deterministic:
                    break  # runs alone once the batch is empty (_admit_solo)
                if self._follow(r):  # decoded in its leader's row: no row, no prefill
                    self._waiting.popleft()
                    continue
                if len(self._batch) + len(new) >= self.max_batch_size:
                    break
                key = tuple(r.input_ids) if r.mm is None else None
                cost = 0 if key in seen else len(r.input_ids)  # repeats are prefilled once
                if new and budget - cost < 0:
                    break
                budget -= cost
                if key is not None:
                    seen.add(key)
                new.append(self._waiting.popleft())
                gkey = r.greedy_key()
                if gkey is not None:  # identical greedy requests from now on follow it
                    self._greedy_leaders[gkey] = r
        if not new:
            return
        if self._batch.shared:
            self._admit_shared(new)
            return
        # Identical prompts (n samples of one prompt) are prefilled once and their cache
        # rows copied: the same computation, done once.
        slot: dict[Any, int] = {}
        uniq: list[Request] = []
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
        if self._routing is not None:  # prompt positions' experts, per request
            P = mask.shape[1]
            routed = self._routing.take().view(len(uniq), P, *self._routing_shape())
            for r, j in zip(new, inverse):
                if r.params.return_routed_experts:
                    r.routed.append(routed[j, P - len(r.input_ids) :].cpu())
        if len(uniq) < len(new):
            inv = torch.tensor(inverse, dtype=torch.long, device=self.device)
            keys = [k.index_select(0, inv) for k in keys]
            values = [v.index_select(0, inv) for v in values]
            logits, mask, next_pos = logits[inv], mask[inv], next_pos[inv]
        tokens, logps = sample_tokens(logits, new, [0] * len(new))
        self._record(new, tokens, logps)
        self._batch.merge(new, keys, values, mask, next_pos, tokens)
        self._finish_done()

    def _admit_solo(self) -> bool:
        """Deterministic requests run alone: admitted only into an empty batch, in a fresh
        unshared ``KVBatch`` (no prompt slots, no prompt LRU, no batched prefill), and
        nothing is admitted beside them. Their arithmetic then depends on the request and
        the weights only, never on what else the server was running. True: the admission
        step is done (a solo request runs or was just admitted)."""
        with self._lock:
            if any(r is not None and r.params.deterministic for r in self._batch.reqs):
                return True
            if not self._waiting or not self._waiting[0].params.deterministic:
                if not len(self._batch) and self._batch.shared != self._shared:
                    self._batch = KVBatch(self._shared)  # back to the usual layout
                return False
            if len(self._batch):
                return True  # wait until the running requests leave
            r = self._waiting.popleft()
        self._batch = KVBatch(False)
        keys, values, logits, mask, next_pos = self._prefill([r])
        if self._routing is not None:  # prompt positions' experts
            P = mask.shape[1]
            routed = self._routing.take().view(1, P, *self._routing_shape())
            if r.params.return_routed_experts:
                r.routed.append(routed[0, P - len(r.input_ids) :].cpu())
        tokens, logps = sample_tokens(logits, [r], [0])
        self._record([r], tokens, logps)
        self._batch.merge([r], keys, values, mask, next_pos, tokens)
        self._finish_done()
        return True

    def _admit_shared(self, new: list[Request]) -> None:
        """Admission in the shared layout: a prompt already running (or in the LRU) is not
        prefilled again; new rows point to their prompt's slot and start with no columns."""
        slots = self._batch.slots
        keyed = [tuple(r.input_ids) for r in new]
        missing: dict[tuple[int, ...], Request] = {}
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
        tokens, logps = sample_tokens(logits, new, [0] * len(new))
        self._record(new, tokens, logps)
        n, kv, D = len(new), self._fast.n_kv, self._fast.head_dim
        dt = logits.dtype if not slots.keys else slots.keys[0].dtype
        empty = [torch.zeros(n, kv, 0, D, dtype=dt, device=self.device)] * len(self._fast.layers)
        next_pos = torch.tensor([len(r.input_ids) for r in new], device=self.device)
        mask = torch.zeros(n, 0, dtype=torch.long, device=self.device)
        self._batch.merge(new, empty, empty, mask, next_pos, tokens, pids)
        self._finish_done()

    def _prefill_cached(self, uniq: list[Request]):
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
        same_len: dict[int, list[Request]] = {}
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

    def _prefill(self, uniq: list[Request]):
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
            if self._routing is not None:  # the experts of each row's fed token
                routed = self._routing.take().cpu()
                for i in b.live:
                    if b.reqs[i].params.return_routed_experts:
                        b.reqs[i].routed.append(routed[i : i + 1])
        b.mask = mask
        b.T += 1
        live = b.live
        reqs = [b.reqs[i] for i in live]
        if len(live) < B:
            idx = torch.tensor(live, dtype=torch.long, device=logits.device)
            logits = logits.index_select(0, idx)
        tokens, logps = sample_tokens(logits, reqs, [len(r.output_ids) for r in reqs])
        if len(live) < B:
            b.next_pos[idx] += 1
            b.next_tok[idx] = tokens
        else:
            b.next_pos = b.next_pos + 1
            b.next_tok = tokens
        self._record(reqs, tokens, logps)
        self._finish_done()

    def _routing_shape(self) -> tuple[int, int]:
        cfg = self.model.config
        return self._routing.n_layers, int(cfg.num_experts_per_tok)

    def _hf_decode(self, b: KVBatch, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=b.next_tok.unsqueeze(1),
            attention_mask=mask,
            position_ids=b.next_pos.unsqueeze(1),
            cache=b.cache(),
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def _record(self, reqs: list[Request], tokens: torch.Tensor, logps: torch.Tensor) -> None:
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
            for f in r.followers:  # identical greedy requests: the same token
                if f.first_token_time is None:
                    f.first_token_time = now
                f.output_ids.append(t)
                f.output_logprobs.append(lp)
                f.output_versions.append(v)
                f.done, f.finish = r.done, r.finish
        n_out = len(reqs) + sum(len(r.followers) for r in reqs)
        with self._lock:
            self._generated_total += n_out
            self._token_times.append((now, n_out))

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
            key = r.greedy_key()
            if key is not None and self._greedy_leaders.get(key) is r:
                del self._greedy_leaders[key]
            for f in r.followers:
                self._deliver(f, reason or f.finish)
            r.followers = []
            self._deliver(r, reason or r.finish)

    def _deliver(self, r: Request, reason: str) -> None:
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
        if r.params.return_routed_experts:
            if self._routing is None:
                result["routed_experts"] = None  # a dense model routes nothing
            else:
                result["routed_experts"] = torch.cat(r.routed)[
                    : len(r.input_ids) + len(r.output_ids) - 1
                ].tolist()
        try:
            r.callback(result)
        except Exception:
            logger.exception("result callback of %s failed", r.rid)

    def _fail_all(self, message: str) -> None:
        reqs = [r for r in self._batch.reqs if r is not None]
        reqs += [f for r in reqs for f in r.followers]
        self._batch = KVBatch(self._shared)
        self._greedy_leaders.clear()
        with self._lock:
            reqs.extend(self._waiting)
            self._waiting.clear()
            # Requests taken from the queue but not yet in the batch (a failed admission)
            listed = {id(r) for r in reqs}
            reqs.extend(r for r in self._rids.values() if id(r) not in listed)
        for r in reqs:
            with self._lock:
                if self._rids.get(r.rid) is r:
                    del self._rids[r.rid]
            try:
                r.callback({"rid": r.rid, "error": message})
            except Exception:
                logger.exception("result callback of %s failed", r.rid)
