"""Built-in server decode path: fast decode step, segmented attention, row sorting,
shared prefill of identical prompts, inverse-CDF sampling (all against the HF forward)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from _hf_reference import hf_greedy, hf_logprobs, hf_model

from areal.inference.server.core import GenerationCore, SamplingParams
from areal.inference.server.decode import FastDecoder
from areal.inference.server.requests import Request
from areal.inference.server.sampling import draw, sample_tokens, seeded_uniforms


def _run(core, jobs, timeout=180):
    """Submit ``(prompt, params)`` jobs (a few at a time, so they join a running batch)."""
    results: dict[int, dict] = {}
    done = threading.Event()

    def cb(i):
        def f(r):
            results[i] = r
            if len(results) == len(jobs):
                done.set()

        return f

    try:
        for i, (p, sp) in enumerate(jobs):
            core.submit(str(i), p, sp, cb(i))
            if i % 5 == 4:
                threading.Event().wait(0.01)
        assert done.wait(timeout)
    finally:
        core.shutdown()
    return [results[i] for i in range(len(jobs))]


def _count_prefills(core) -> list[int]:
    """A list that gets the row count of every prefill forward (more than one token) of
    ``core``'s model."""
    rows: list[int] = []
    forward = core.model.forward

    def spy(*a, **k):
        if k["input_ids"].shape[1] > 1:
            rows.append(k["input_ids"].shape[0])
        return forward(*a, **k)

    core.model.forward = spy
    return rows


def _run_together(core, jobs, timeout: float = 120.0) -> dict[int, dict]:
    """Submit ``jobs`` (prompt, SamplingParams) to a paused ``core`` so they are admitted
    together, resume it, wait for every result and shut the core down."""
    results: dict[int, dict] = {}
    done = threading.Event()
    for i, (p, sp) in enumerate(jobs):

        def cb(r, i=i):
            results[i] = r
            if len(results) == len(jobs):
                done.set()

        core.submit(str(i), p, sp, cb)
    core.resume().result()
    try:
        assert done.wait(timeout)
    finally:
        core.shutdown()
    return results


def test_fast_decoder_built_for_qwen2_and_refused_for_unknown_structures(tiny_model_dir):
    model = hf_model(tiny_model_dir)
    assert FastDecoder.build(model) is not None
    model.config.model_type = "gpt2"
    assert FastDecoder.build(model) is None
    model.config.model_type = "qwen2"
    model.config.layer_types = ["sliding_attention"] * len(model.model.layers)
    assert FastDecoder.build(model) is None


def test_segmented_sorted_decode_greedy_matches_hf_generate_and_logprobs(tiny_model_dir):
    """Segments of 3 rows, staggered arrivals, rows freed and re-sorted: greedy tokens equal
    HF generate's and logprobs HF forward's (atol 1e-4)."""
    torch.set_num_threads(1)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=16, segment_rows=3)
    assert core._fast is not None
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(2, 70))] for _ in range(45)]
    lens = [rng.randrange(1, 60) for _ in prompts]
    sorts = []
    orig = core._batch.__class__.sort_rows

    def counting_sort(self, *a):
        moved = orig(self, *a)
        sorts.append(moved)
        return moved

    core._batch.sort_rows = counting_sort.__get__(core._batch)
    jobs = [(p, SamplingParams(max_new_tokens=n, greedy=True)) for p, n in zip(prompts, lens)]
    results = _run(core, jobs)
    assert core._fast is not None, "fast path disagreed with the HF forward"
    assert any(sorts), "rows were never re-sorted: the test does not cover sort_rows"
    for (p, _), n, r in zip(jobs, lens, results):
        assert r["output_ids"] == hf_greedy(model, p, n)
        ref = hf_logprobs(model, p, r["output_ids"])
        torch.testing.assert_close(torch.tensor(r["output_logprobs"]), ref, atol=1e-4, rtol=0)


def test_fast_and_hf_decode_paths_give_same_greedy_tokens(tiny_model_dir):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(2, 40))] for _ in range(12)]
    outs = []
    for fast in (True, False):
        core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=8, fast_decode=fast)
        assert (core._fast is not None) == fast
        jobs = [(p, SamplingParams(max_new_tokens=30, greedy=True)) for p in prompts]
        outs.append([r["output_ids"] for r in _run(core, jobs)])
    assert outs[0] == outs[1]


def test_identical_prompts_are_prefilled_once_and_sampled_independently(tiny_model_dir):
    torch.set_num_threads(1)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=32)
    prefill_rows = _count_prefills(core)
    core.pause().result()  # hold the requests so they are admitted together
    prompt_a, prompt_b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    jobs = [(prompt_a, SamplingParams(max_new_tokens=12, temperature=1.0)) for _ in range(8)]
    jobs += [(prompt_b, SamplingParams(max_new_tokens=12, temperature=1.0)) for _ in range(8)]
    results = _run_together(core, jobs)
    assert sorted(prefill_rows) == [1, 1]  # 16 requests, 2 distinct prompts (lengths 6, 3)
    outs = [tuple(results[i]["output_ids"]) for i in range(16)]
    assert len(set(outs[:8])) > 1 and len(set(outs[8:])) > 1  # samples differ
    for i, (p, _) in enumerate(jobs):
        ref = hf_logprobs(model, p, results[i]["output_ids"])
        torch.testing.assert_close(
            torch.tensor(results[i]["output_logprobs"]), ref, atol=1e-4, rtol=0
        )


def test_identical_greedy_requests_decode_in_one_row_match_hf_and_survive_leader_abort(
    tiny_model_dir,
):
    """n identical greedy requests take one row (a later identical one joins the running
    row): tokens equal HF generate's, logprobs HF forward's; aborting the row's owner
    hands the row to an identical request, which still gets its full answer."""
    torch.set_num_threads(1)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=32)
    prompt_a, prompt_b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    greedy = SamplingParams(max_new_tokens=20, greedy=True)
    jobs = [(prompt_a, greedy)] * 4 + [(prompt_b, greedy)] * 3
    jobs += [(prompt_b, SamplingParams(max_new_tokens=7, greedy=True))]  # other limit
    jobs += [(prompt_b, SamplingParams(max_new_tokens=20, temperature=1.0))]  # sampled
    late = len(jobs)
    jobs += [(prompt_a, greedy)]  # submitted while the others run
    results: dict[int, dict] = {}
    done = threading.Event()

    def cb(i):
        def f(r):
            results[i] = r
            if len(results) == len(jobs):
                done.set()

        return f

    rows: list[int] = []
    step = core._decode_step

    def spy():
        rows.append(len(core._batch))
        if len(rows) == 3:
            core.abort("0")  # the first request of prompt_a owns its row
            core.submit(str(late), jobs[late][0], jobs[late][1], cb(late))
        step()

    core._decode_step = spy
    core.pause().result()
    for i, (p, sp) in enumerate(jobs[:late]):
        core.submit(str(i), p, sp, cb(i))
    core.resume().result()
    try:
        assert done.wait(120)
    finally:
        core.shutdown()
    assert max(rows) == 4  # prompt_a, prompt_b x 20, prompt_b x 7, the sampled one
    assert results[0]["finish_reason"] == "abort"
    ref_a = hf_greedy(model, prompt_a, 20)
    assert 0 < len(results[0]["output_ids"]) < 20
    assert results[0]["output_ids"] == ref_a[: len(results[0]["output_ids"])]
    for i in (1, 2, 3, late):
        assert results[i]["finish_reason"] != "abort"
        assert results[i]["output_ids"] == ref_a
    for i in (4, 5, 6):
        assert results[i]["output_ids"] == hf_greedy(model, prompt_b, 20)
    assert results[7]["output_ids"] == hf_greedy(model, prompt_b, 7)
    for i, (p, _) in enumerate(jobs):
        ref = hf_logprobs(model, p, results[i]["output_ids"])
        torch.testing.assert_close(
            torch.tensor(results[i]["output_logprobs"]), ref, atol=1e-4, rtol=0
        )


def test_inverse_cdf_draw_follows_probs_and_never_picks_zero_probability_tokens():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3])
    rows = probs.expand(40000, 5).contiguous()
    counts = torch.bincount(draw(rows), minlength=5).double() / rows.shape[0]
    assert counts[1] == 0 and counts[3] == 0
    torch.testing.assert_close(counts, probs.double(), atol=0.01, rtol=0)
    # unnormalised rows (masked softmax outputs) are fine as well
    assert set(draw(torch.tensor([[0.0, 0.0, 3.0]] * 50)).tolist()) == {2}


def test_seeded_uniforms_are_a_pure_function_of_seed_and_count_and_uniform():
    seeds, counts = [3, 3, 7, 2**64 - 1], [0, 1, 0, 9]
    u = seeded_uniforms(seeds, counts)
    # the same (seed, count) gives the same number in any batch and order
    assert seeded_uniforms(seeds[::-1], counts[::-1]).flip(0).equal(u)
    assert seeded_uniforms([7], [0]).item() == u[2].item()
    assert len(set(u.tolist())) == 4
    many = seeded_uniforms(list(range(50_000)), [5] * 50_000)
    assert 0.0 <= many.min() and many.max() < 1.0
    hist = torch.histc(many.float(), bins=10, min=0.0, max=1.0) / many.numel()
    torch.testing.assert_close(hist, torch.full((10,), 0.1), atol=0.006, rtol=0)
    stream = seeded_uniforms([11] * 50_000, list(range(50_000)))  # one stream over time
    hist = torch.histc(stream.float(), bins=10, min=0.0, max=1.0) / stream.numel()
    torch.testing.assert_close(hist, torch.full((10,), 0.1), atol=0.006, rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.96])
def test_seeded_rows_sample_batched_reproducibly_and_follow_the_distribution(top_p):
    """Seeded rows (plain, or through the top-p path) are drawn together: each row's token
    depends on its seed and token count only, not on the other rows, and over many seeds
    the tokens follow the softmax (top-p 0.96 here removes nothing: the smallest token
    starts at 0.95 of the mass)."""
    probs = torch.tensor([0.5, 0.05, 0.2, 0.1, 0.15])
    logits = probs.log()

    def req(seed):
        params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=top_p, seed=seed)
        return Request(f"r{seed}", [1, 2], params, lambda r: None, frozenset())

    reqs = [req(s) for s in range(20_000)]
    tokens, logps = sample_tokens(logits.expand(len(reqs), 5), reqs, [3] * len(reqs))
    freq = torch.bincount(tokens, minlength=5).double() / len(reqs)
    torch.testing.assert_close(freq, probs.double(), atol=0.012, rtol=0)
    torch.testing.assert_close(logps, logits[tokens], atol=1e-6, rtol=0)
    # a row alone, or among other (unseeded, greedy) rows, draws the same token
    mixed = [reqs[5], req(None), reqs[9]]
    mixed[1].params.greedy = True
    alone, _ = sample_tokens(logits.expand(1, 5), [reqs[9]], [3])
    together, _ = sample_tokens(logits.expand(3, 5), mixed, [3, 0, 3])
    assert together[2] == alone[0] == tokens[9] and together[0] == tokens[5]
    # the next token of the same row comes from the next number of its stream
    later, _ = sample_tokens(logits.expand(len(reqs), 5), reqs, [4] * len(reqs))
    assert not later.equal(tokens)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_plain_sampling_logprobs_are_temperature_scaledhf_logprobs(tiny_model_dir, temperature):
    torch.set_num_threads(1)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=8)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    sp = SamplingParams(max_new_tokens=20, temperature=temperature)
    results = _run(core, [(p, sp) for p in prompts])
    for p, r in zip(prompts, results):
        ref = hf_logprobs(model, p, r["output_ids"], temperature)
        torch.testing.assert_close(torch.tensor(r["output_logprobs"]), ref, atol=1e-4, rtol=0)


def test_prompt_cache_reused_across_admissions_and_emptied_by_weight_updates(tiny_model_dir):
    torch.set_num_threads(1)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=4)
    prefills = _count_prefills(core)
    prompt = [7, 8, 9, 10, 11]

    def greedy():
        out = {}
        ev = threading.Event()
        core.submit(
            "x",
            prompt,
            SamplingParams(max_new_tokens=8, greedy=True),
            lambda r: (out.update(r), ev.set()),
        )
        assert ev.wait(60)
        return out

    try:
        first, second = greedy(), greedy()
        assert prefills == [1]  # the second request reused the cached prompt
        assert second["output_ids"] == first["output_ids"]

        def change_weights():
            with torch.no_grad():
                core.model.lm_head.weight.mul_(-1.0)

        core.run_command(change_weights).result()
        third = greedy()
        assert prefills == [1, 1]  # prefilled again with the new weights
    finally:
        core.shutdown()
    model = hf_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    assert third["output_ids"] == hf_greedy(model, prompt, 8)
    ref = hf_logprobs(model, prompt, third["output_ids"])
    torch.testing.assert_close(torch.tensor(third["output_logprobs"]), ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- shared prompt slots


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_attend_matches_plain_softmax_attention_with_padding_bias(cpu_kernel, monkeypatch):
    from areal.inference.server import decode

    if not cpu_kernel:  # the formula other devices use
        monkeypatch.setattr(decode, "_CPU_FLASH", None)
    torch.manual_seed(0)
    q = torch.randn(3, 2, 5, 8)
    k, v = torch.randn(3, 2, 11, 8), torch.randn(3, 2, 11, 8)
    bias = torch.zeros(3, 1, 1, 11)
    bias[0, ..., :4] = torch.finfo(torch.float32).min  # ragged: left padding per row
    bias[2, ..., 7:] = torch.finfo(torch.float32).min
    out, lse = decode.attend(q, k, v, bias)
    scores = q @ k.transpose(-1, -2) + bias
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-5, rtol=0)


def test_slot_chunks_cover_all_slots_and_split_where_prompts_get_much_shorter():
    from areal.inference.server.kv_batch import chunks_cost, slot_chunks

    lens = [300, 280, 0, 250, 150, 140, 60, 50, 40]
    chunks = slot_chunks(lens)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous
    for s0, s1, cols in chunks:  # every prompt fits its range's columns
        assert max(lens[s0:s1]) <= cols
    assert len(chunks) == 3 and chunks_cost(chunks) < len(lens) * max(lens)
    assert slot_chunks([5]) == [(0, 1, 5)]
    assert len(slot_chunks(list(range(400, 0, -10)))) <= 4  # capped


def _mixed_group_jobs(seed: int, greedy: bool):
    """Prompts of different lengths, each sent 1, 2, 3 or 6 times (groups), interleaved."""
    rng = random.Random(seed)
    jobs = []
    for g in range(14):
        prompt = [rng.randrange(3, 400) for _ in range(rng.randrange(2, 90))]
        n = [1, 2, 3, 6][g % 4]
        max_new = rng.randrange(1, 40)
        sp = SamplingParams(max_new_tokens=max_new, greedy=greedy, temperature=1.0)
        jobs += [(prompt, sp)] * n
    rng.shuffle(jobs)
    return jobs


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_shared_prompt_slots_with_mixed_group_sizes_match_hf(
    tiny_model_dir, cpu_kernel, monkeypatch
):
    """Groups of 1-6 samples of prompts of different lengths, staggered arrivals, a small
    batch (rows refilled, slots freed and reused, slots re-sorted): greedy tokens equal HF
    generate's and logprobs HF forward's (atol 1e-4); samples of one prompt share a slot.
    Also with the plain attention formula that devices other than the CPU use."""
    from areal.inference.server import decode

    if not cpu_kernel:
        monkeypatch.setattr(decode, "_CPU_FLASH", None)
    torch.set_num_threads(1)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=10, segment_rows=4)
    assert core._batch.shared
    seen = {"sorted": 0, "max_rows_per_slot": 0, "chunks": 0}
    batch_cls = core._batch.__class__
    orig_sort, orig_prefix = batch_cls.sort_slots, batch_cls.prefix

    def sort_slots(self):
        moved = orig_sort(self)
        seen["sorted"] += moved
        return moved

    def prefix(self, n_kv):
        p = orig_prefix(self, n_kv)
        seen["max_rows_per_slot"] = max(seen["max_rows_per_slot"], p.rows_per_slot)
        seen["chunks"] = max(seen["chunks"], len(p.chunks))
        return p

    batch_cls.sort_slots, batch_cls.prefix = sort_slots, prefix
    try:
        jobs = _mixed_group_jobs(5, greedy=True) + _mixed_group_jobs(6, greedy=False)
        results = _run(core, jobs)
    finally:
        batch_cls.sort_slots, batch_cls.prefix = orig_sort, orig_prefix
    assert core._fast is not None, "fast path disagreed with the HF forward"
    assert seen["max_rows_per_slot"] > 1, "no two rows shared a prompt slot"
    assert seen["sorted"] and seen["chunks"] > 1, "slot sorting / ranges not covered"
    for (p, sp), r in zip(jobs, results):
        if sp.greedy:
            assert r["output_ids"] == hf_greedy(model, p, sp.max_new_tokens)
        ref = hf_logprobs(model, p, r["output_ids"])
        torch.testing.assert_close(torch.tensor(r["output_logprobs"]), ref, atol=1e-4, rtol=0)


def test_fast_path_disagreeing_falls_back_to_hf_with_the_shared_batch_unshared(
    tiny_model_dir, monkeypatch
):
    """If the first decode step's check fails, the running shared-layout batch is rebuilt
    in the plain layout and every request continues on the HF forward, still exact."""
    torch.set_num_threads(1)
    monkeypatch.setattr(FastDecoder, "matches_reference", lambda self, a, b: False)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=12)
    core.pause().result()  # admit together: the check runs on a batch with shared slots
    jobs = _mixed_group_jobs(8, greedy=True)[:12]
    results = _run_together(core, jobs)
    assert core._fast is None and not core._shared and not core._batch.shared
    for i, (p, sp) in enumerate(jobs):
        assert results[i]["output_ids"] == hf_greedy(model, p, sp.max_new_tokens)
        ref = hf_logprobs(model, p, results[i]["output_ids"])
        torch.testing.assert_close(
            torch.tensor(results[i]["output_logprobs"]), ref, atol=1e-4, rtol=0
        )


def test_running_prompt_slot_not_reused_after_a_weight_update(tiny_model_dir):
    """A prompt still running when the weights change keeps its slot for its rows, but a
    new request with that prompt is prefilled again with the new weights."""
    torch.set_num_threads(1)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=4)
    prefills = _count_prefills(core)
    prompt = [7, 8, 9, 10, 11, 12]
    long_done, out = threading.Event(), {}
    core.submit(
        "long",
        prompt,
        SamplingParams(max_new_tokens=400, ignore_eos=True, greedy=True),
        lambda r: long_done.set(),
    )
    try:
        while not core._batch.reqs:  # running
            threading.Event().wait(0.01)

        def change_weights():
            with torch.no_grad():
                core.model.lm_head.weight.mul_(-1.0)

        core.run_command(change_weights).result()
        ev = threading.Event()
        core.submit(
            "new",
            prompt,
            SamplingParams(max_new_tokens=8, greedy=True),
            lambda r: (out.update(r), ev.set()),
        )
        assert ev.wait(60)
        assert long_done.wait(120)
    finally:
        core.shutdown()
    assert prefills == [1, 1]
    model = hf_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    assert out["output_ids"] == hf_greedy(model, prompt, 8)
