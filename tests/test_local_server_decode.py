"""Built-in server decode path: fast decode step, segmented attention, row sorting,
shared prefill of identical prompts, inverse-CDF sampling (all against the HF forward)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from _hf_reference import hf_greedy, hf_logprobs, hf_model

from areal.engine.local_server.core import GenerationCore, SamplingParams, _draw
from areal.engine.local_server.decode import FastDecoder


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
    prefill_rows = []
    forward = core.model.forward

    def spy(*a, **k):
        if k["input_ids"].shape[1] > 1:
            prefill_rows.append(k["input_ids"].shape[0])
        return forward(*a, **k)

    core.model.forward = spy
    core.pause().result()  # hold the requests so they are admitted together
    prompt_a, prompt_b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    jobs = [(prompt_a, SamplingParams(max_new_tokens=12, temperature=1.0)) for _ in range(8)]
    jobs += [(prompt_b, SamplingParams(max_new_tokens=12, temperature=1.0)) for _ in range(8)]
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
        assert done.wait(120)
    finally:
        core.shutdown()
    assert prefill_rows == [2]  # 16 requests, 2 distinct prompts
    outs = [tuple(results[i]["output_ids"]) for i in range(16)]
    assert len(set(outs[:8])) > 1 and len(set(outs[8:])) > 1  # samples differ
    for i, (p, _) in enumerate(jobs):
        ref = hf_logprobs(model, p, results[i]["output_ids"])
        torch.testing.assert_close(
            torch.tensor(results[i]["output_logprobs"]), ref, atol=1e-4, rtol=0
        )


def test_inverse_cdf_draw_follows_probs_and_never_picks_zero_probability_tokens():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3])
    rows = probs.expand(40000, 5).contiguous()
    counts = torch.bincount(_draw(rows), minlength=5).double() / rows.shape[0]
    assert counts[1] == 0 and counts[3] == 0
    torch.testing.assert_close(counts, probs.double(), atol=0.01, rtol=0)
    # unnormalised rows (masked softmax outputs) are fine as well
    assert set(_draw(torch.tensor([[0.0, 0.0, 3.0]] * 50)).tolist()) == {2}


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
    prefills = []
    forward = core.model.forward

    def spy(*a, **k):
        if k["input_ids"].shape[1] > 1:
            prefills.append(k["input_ids"].shape[0])
        return forward(*a, **k)

    core.model.forward = spy
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
