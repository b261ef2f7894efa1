"""RemoteInfEngine against real built-in server processes on loopback (tiny model)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import requests
import torch
from _hf_reference import hf_logprobs, hf_model
from conftest import build_tiny_qwen2

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.inference.clients.local import RemoteLocalEngine
from areal.inference.server.launch import launch_local_server
from areal.inference.server.weights import init_custom_process_group
from areal.infra.remote_inf_engine import NoHealthyServerError
from areal.utils.network import find_free_ports


def _cfg(**kw):
    kw.setdefault("request_timeout", 60)
    kw.setdefault("request_retries", 3)
    kw.setdefault("setup_timeout", 60)
    return InferenceEngineConfig(**kw)


def _req(prompt, **g):
    return ModelRequest(input_ids=prompt, gconfig=GenerationHyperparameters(**g))


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    group = launch_local_server(tiny_model_dir, num_servers=1, timeout=120)
    try:
        yield group
    finally:
        group.shutdown()


@pytest.fixture
def engine(servers):
    eng = RemoteLocalEngine(_cfg())
    eng.initialize(servers.addresses)
    try:
        yield eng
    finally:
        eng.destroy()


async def test_agenerate_greedy_matches_hf(engine, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    prompt = [11, 12, 13, 14, 15]
    resp = await engine.agenerate(_req(prompt, max_new_tokens=25, greedy=True))
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=25, do_sample=False, eos_token_id=2, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert resp.output_tokens == ref
    torch.testing.assert_close(
        torch.tensor(resp.output_logprobs), hf_logprobs(model, prompt, ref), atol=1e-4, rtol=0
    )
    assert resp.input_tokens == prompt and resp.output_versions == [0] * len(ref)
    assert resp.latency > 0 and resp.ttft <= resp.latency


async def test_agenerate_64_concurrent_different_lengths_all_complete(engine):
    rng = random.Random(0)
    reqs = [
        _req(
            [rng.randrange(3, 400) for _ in range(rng.randrange(2, 60))],
            max_new_tokens=rng.randrange(1, 80),
            ignore_eos=True,
        )
        for _ in range(64)
    ]
    resps = await asyncio.gather(*[engine.agenerate(r) for r in reqs])
    for r, resp in zip(reqs, resps):
        assert resp.output_len == r.gconfig.max_new_tokens and resp.stop_reason == "length"
        assert len(resp.output_logprobs) == len(resp.output_versions) == resp.output_len


async def test_agenerate_bad_request_raises_value_error(engine):
    with pytest.raises(ValueError, match="400"):
        await engine.agenerate(_req([5, 100000], max_new_tokens=3))
    with pytest.raises(ValueError, match="max_tokens"):
        await engine.agenerate(_req([5] * 10, max_new_tokens=3, max_tokens=10))


def test_agenerate_from_background_loop_and_own_loop(engine):
    results = []

    def bg():
        results.append(
            asyncio.run(engine.agenerate(_req([5, 6], max_new_tokens=4, ignore_eos=True)))
        )

    t = threading.Thread(target=bg)
    t.start()
    results.append(asyncio.run(engine.agenerate(_req([7, 8], max_new_tokens=4, ignore_eos=True))))
    t.join(60)
    assert [r.output_len for r in results] == [4, 4]


def test_initialize_reads_env_addresses(servers, monkeypatch):
    monkeypatch.setenv("AREAL_LLM_SERVER_ADDRS", ",".join(servers.addresses))
    eng = RemoteLocalEngine(_cfg())
    eng.initialize()
    try:
        assert eng.addresses == servers.addresses
        assert eng.workflow_executor is not None
    finally:
        eng.destroy()


def test_initialize_without_addresses_raises(monkeypatch):
    monkeypatch.delenv("AREAL_LLM_SERVER_ADDRS", raising=False)
    with pytest.raises(ValueError, match="no inference server addresses"):
        RemoteLocalEngine(_cfg()).initialize()


# ---------------------------------------------------------------------------- weights


@pytest.fixture(scope="module")
def weight_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    v0 = build_tiny_qwen2(str(root / "v0"), seed=0)
    v1 = build_tiny_qwen2(str(root / "v1"), seed=1)
    group = launch_local_server(v0, num_servers=1, timeout=120)
    try:
        yield v0, v1, group
    finally:
        group.shutdown()


def _check_versions_and_logprobs(resp, prompt, models):
    vs = resp.output_versions
    assert sorted(set(vs)) == sorted(models), vs
    assert vs == sorted(vs), "versions must be contiguous (old weights first)"
    for i, (tok_v, lp) in enumerate(zip(vs, resp.output_logprobs)):
        ref = hf_logprobs(models[tok_v], prompt + resp.output_tokens[:i], [resp.output_tokens[i]])
        assert abs(float(ref[0]) - lp) < 1e-4, (i, tok_v, float(ref[0]), lp)


@pytest.mark.slow
def test_pause_disk_reload_continue_spans_both_versions(weight_setup):
    v0, v1, group = weight_setup
    eng = RemoteLocalEngine(_cfg())
    eng.initialize(group.addresses)
    addr = group.addresses[0]
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    out: list = []

    def gen():
        async def main():
            return await asyncio.gather(
                *[
                    eng.agenerate(_req(p, max_new_tokens=400, greedy=True, ignore_eos=True))
                    for p in prompts
                ]
            )

        out.extend(asyncio.run(main()))

    try:
        t = threading.Thread(target=gen)
        t.start()
        deadline = time.time() + 60
        while (
            requests.get(f"http://{addr}/metrics", timeout=10).json()["generated_tokens_total"]
            < 100
        ):
            assert time.time() < deadline
            time.sleep(0.01)
        # as WeightSynchronizer does: pause, load as pending, commit, continue
        eng.pause_generation()
        eng.update_weights_from_disk(WeightUpdateMeta(type="disk", path=v1, version=1)).result(
            timeout=60
        )
        assert eng.get_version() == 0  # pending until the commit
        assert requests.get(f"http://{addr}/get_version", timeout=10).json()["version"] == 0
        assert eng.commit_weights(1) == []
        eng.continue_generation()
        assert eng.get_version() == 1
        t.join(120)
        models = {0: hf_model(v0), 1: hf_model(v1)}
        for p, resp in zip(prompts, out):
            assert resp.output_len == 400 and resp.stop_reason == "length"
            _check_versions_and_logprobs(resp, p, models)
    finally:
        eng.update_weights_from_disk(WeightUpdateMeta(type="disk", path=v0, version=0)).result(
            timeout=60
        )
        eng.commit_weights(0)
        eng.destroy()


@pytest.mark.slow
def test_distributed_gloo_update_reproduces_weights(weight_setup):
    v0, v1, group = weight_setup
    eng = RemoteLocalEngine(_cfg())
    eng.initialize(group.addresses)
    try:
        port = find_free_ports(1)[0]
        meta = WeightUpdateMeta(
            type="xccl", master_port=port, backend="gloo", group_name="test_wu", version=5
        )
        fut = eng.init_weights_update_group(meta)
        pg = init_custom_process_group("gloo", "127.0.0.1", port, meta.world_size, 0, "test_wu")
        fut.result(timeout=60)
        new = hf_model(v1)
        named = list(new.state_dict().items())
        buckets = [named[: len(named) // 2], named[len(named) // 2 :]]
        eng.pause_generation()
        for bucket in buckets:
            specs = [
                ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket
            ]
            f = eng.update_weights_from_distributed(meta, specs)
            for _, t in bucket:
                pg.broadcast(t.contiguous(), 0).wait()
            f.result(timeout=60)
        assert eng.get_version() == 0  # pending until the commit
        eng.commit_weights(5)
        eng.continue_generation()
        assert eng.get_version() == 5
        prompt = [9, 10, 11]
        resp = asyncio.run(
            eng.agenerate(_req(prompt, max_new_tokens=20, greedy=True, ignore_eos=True))
        )
        assert resp.output_versions == [5] * 20
        torch.testing.assert_close(
            torch.tensor(resp.output_logprobs),
            hf_logprobs(new, prompt, resp.output_tokens),
            atol=1e-4,
            rtol=0,
        )
    finally:
        eng.update_weights_from_disk(WeightUpdateMeta(type="disk", path=v0, version=0)).result(
            timeout=60
        )
        eng.commit_weights(0)
        eng.destroy()


# ---------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_killing_one_of_two_servers_loses_no_request(tiny_model_dir):
    group = launch_local_server(tiny_model_dir, num_servers=2, timeout=120)
    eng = RemoteLocalEngine(_cfg(request_retries=4))
    eng.initialize(group.addresses)
    try:
        reqs = [_req([5 + i, 6, 7], max_new_tokens=150, ignore_eos=True) for i in range(32)]
        out: list = []

        def gen():
            async def main():
                return await asyncio.gather(*[eng.agenerate(r) for r in reqs])

            out.extend(asyncio.run(main()))

        t = threading.Thread(target=gen)
        t.start()
        victim = group.servers[0]
        deadline = time.time() + 60
        while (
            requests.get(f"http://{victim.address}/metrics", timeout=10).json()[
                "generated_tokens_total"
            ]
            < 50
        ):
            assert time.time() < deadline
            time.sleep(0.01)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        t.join(180)
        assert len(out) == 32
        assert all(r.output_len == 150 for r in out)
        assert eng.healthy_addresses == [group.servers[1].address]
        # the last server dies too: a clear error, not a hang
        os.killpg(group.servers[1].proc.pid, signal.SIGKILL)
        with pytest.raises(
            (NoHealthyServerError, RuntimeError), match="no healthy inference server|failed after"
        ):
            asyncio.run(eng.agenerate(_req([5], max_new_tokens=3)))
    finally:
        eng.destroy()
        group.shutdown()


@pytest.mark.slow
def test_launch_server_and_teardown_via_engine(tiny_model_dir):
    eng = RemoteLocalEngine(_cfg())
    addrs = eng.launch_server({"model_path": tiny_model_dir, "max_batch_size": 8})
    try:
        eng.initialize()
        resp = asyncio.run(eng.agenerate(_req([5, 6], max_new_tokens=3, ignore_eos=True)))
        assert resp.output_len == 3
    finally:
        eng.destroy()
        eng.teardown_server()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{addrs[0]}/health", timeout=5)
