"""Built-in inference server: generation core (in process) and HTTP server (subprocess)."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
import requests
import torch
from _hf_reference import hf_greedy, hf_logprobs, hf_model

from areal.inference.server.core import GenerationCore, RequestError, SamplingParams
from areal.inference.server.launch import launch_local_server
from areal.infra.launcher.server_process import launch_server_process
from areal.utils.auth import SERVER_API_KEY_ENV, auth_headers, get_run_secret

# Control endpoints need the run secret (the session's, set in conftest.py).
CTL = requests.Session()
CTL.headers.update(auth_headers(get_run_secret()))


def _prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    group = launch_local_server(tiny_model_dir, num_servers=1, timeout=120)
    try:
        yield group.addresses[0]
    finally:
        group.shutdown()


def _generate(addr, input_ids, **sp):
    r = CTL.post(
        f"http://{addr}/generate", json={"input_ids": input_ids, "sampling_params": sp}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- core


def test_core_staggered_greedy_requests_match_hf_generate(tiny_model_dir):
    """Requests join a running batch at different steps, reuse freed rows, get compacted."""
    torch.set_num_threads(1)
    model = hf_model(tiny_model_dir)
    core = GenerationCore(hf_model(tiny_model_dir), max_batch_size=12)
    prompts = _prompts(40, seed=1, hi=60)
    rng = random.Random(5)
    lens = [rng.randrange(1, 40) for _ in prompts]
    results: dict[int, dict] = {}
    done = threading.Event()

    def cb(i):
        def f(r):
            results[i] = r
            if len(results) == len(prompts):
                done.set()

        return f

    try:
        for i, p in enumerate(prompts):
            core.submit(str(i), p, SamplingParams(max_new_tokens=lens[i], greedy=True), cb(i))
            if i % 3 == 0:
                time.sleep(0.005)
        assert done.wait(120)
    finally:
        core.shutdown()
    for i, p in enumerate(prompts):
        r = results[i]
        assert r["output_ids"] == hf_greedy(model, p, lens[i]), i
        ref = hf_logprobs(model, p, r["output_ids"])
        torch.testing.assert_close(torch.tensor(r["output_logprobs"]), ref, atol=1e-4, rtol=0)
        assert r["finish_reason"] in ("stop", "length")


def test_core_invalid_request_raises_request_error(tiny_model_dir):
    core = GenerationCore(hf_model(tiny_model_dir))
    try:
        with pytest.raises(RequestError, match="context length"):
            core.submit("a", [5] * 600, SamplingParams(), lambda r: None)
        with pytest.raises(RequestError, match="vocab_size"):
            core.submit("b", [5, 100000], SamplingParams(), lambda r: None)
        with pytest.raises(RequestError, match="unknown sampling"):
            SamplingParams.from_dict({"bogus": 1})
        with pytest.raises(RequestError, match="top_p"):
            SamplingParams.from_dict({"top_p": 0})
    finally:
        core.shutdown()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_sampling_params_non_finite_or_negative_temperature_rejected(bad):
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams.from_dict({"temperature": bad})


def test_core_tiny_temperature_is_greedy_with_finite_logprobs(tiny_model_dir):
    sp = SamplingParams.from_dict({"temperature": 1e-300, "max_new_tokens": 8, "ignore_eos": True})
    assert sp.greedy and sp.temperature == 1.0
    model = hf_model(tiny_model_dir)
    core = GenerationCore(model)
    results: dict[str, dict] = {}
    done = threading.Event()
    try:
        core.submit("t", [5, 6, 7], sp, lambda r: (results.update(t=r), done.set()))
        assert done.wait(60)
    finally:
        core.shutdown()
    r = results["t"]
    assert r["output_ids"] == hf_greedy(model, [5, 6, 7], 8)
    assert all(math.isfinite(x) for x in r["output_logprobs"])


# ---------------------------------------------------------------------------- HTTP


def test_generate_greedy_concurrent_matches_hf_generate_and_logprobs(server, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    prompts = _prompts(8, seed=2)
    out: dict[int, dict] = {}

    def go(i):
        out[i] = _generate(server, prompts[i], max_new_tokens=30, greedy=True)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        r = out[i]
        assert r["output_ids"] == hf_greedy(model, p, 30)
        torch.testing.assert_close(
            torch.tensor(r["output_logprobs"]),
            hf_logprobs(model, p, r["output_ids"]),
            atol=1e-4,
            rtol=0,
        )
        assert r["output_versions"] == [0] * len(r["output_ids"])


def test_generate_sampling_logprobs_use_temperature_scaled_distribution(server, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    p = _prompts(1, seed=3)[0]
    r = _generate(
        server, p, max_new_tokens=20, temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True
    )
    assert len(r["output_ids"]) == 20 and r["finish_reason"] == "length"
    ref = hf_logprobs(model, p, r["output_ids"], temperature=0.7)
    torch.testing.assert_close(torch.tensor(r["output_logprobs"]), ref, atol=1e-4, rtol=0)


def test_generate_stop_token_and_min_new_tokens_respected(server, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    p = _prompts(1, seed=4)[0]
    ref = hf_greedy(model, p, 10)
    stop = ref[3]
    first = ref.index(stop)
    r = _generate(server, p, max_new_tokens=10, greedy=True, stop_token_ids=[stop])
    assert r["output_ids"] == ref[: first + 1] and r["finish_reason"] == "stop"
    r = _generate(
        server, p, max_new_tokens=10, min_new_tokens=10, greedy=True, stop_token_ids=[stop]
    )
    assert len(r["output_ids"]) == 10 and r["finish_reason"] == "length"


def test_bad_requests_get_4xx_and_server_keeps_serving(server):
    base = f"http://{server}"
    cases = [
        ("/generate", {"data": "{not json"}),
        ("/generate", {"json": [1, 2]}),
        ("/generate", {"json": {"sampling_params": {}}}),
        ("/generate", {"json": {"input_ids": ["a"]}}),
        ("/generate", {"json": {"input_ids": [1, 99999]}}),
        ("/generate", {"json": {"input_ids": [5] * 600}}),
        ("/generate", {"json": {"input_ids": [5], "sampling_params": {"temperature": -1}}}),
        ("/generate", {"json": {"input_ids": [5], "sampling_params": {"nope": 1}}}),
        ("/v1/completions", {"json": {"prompt": 3}}),
        ("/v1/completions", {"json": {"prompt": "text needs a tokenizer"}}),
        ("/v1/completions", {"json": {"prompt": [5], "n": 0}}),
        ("/v1/chat/completions", {"json": {"messages": "hi"}}),
        ("/set_version", {"json": {"version": "x"}}),
        ("/update_weights_from_disk", {"json": {"model_path": "/nonexistent/dir"}}),
        ("/update_weights_from_distributed", {"json": {"names": []}}),
    ]
    for path, kw in cases:
        r = CTL.post(base + path, timeout=30, **kw)
        assert 400 <= r.status_code < 500, (path, kw, r.status_code, r.text)
        assert "message" in r.json(), r.text
    assert CTL.post(base + "/no_such_endpoint", json={}, timeout=10).status_code == 404
    long = CTL.post(base + "/generate", json={"input_ids": [5] * 600}, timeout=30).json()
    assert "context length" in long["message"]
    assert _generate(server, [5, 6, 7], max_new_tokens=3, greedy=True)["output_ids"]


def test_openai_completions_return_token_ids_and_logprobs(server, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    p = [7, 8, 9, 10]
    r = CTL.post(
        f"http://{server}/v1/completions",
        json={
            "prompt": p,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["token_ids"] == hf_greedy(model, p, 6)
    torch.testing.assert_close(
        torch.tensor(c["logprobs"]["token_logprobs"]),
        hf_logprobs(model, p, c["token_ids"]),
        atol=1e-4,
        rtol=0,
    )
    assert r.json()["usage"]["completion_tokens"] == len(c["token_ids"])


def test_pause_interrupts_inflight_and_continue_serves_again(server):
    res: dict = {}

    def go():
        res["r"] = _generate(server, [5, 6, 7], max_new_tokens=500, ignore_eos=True)

    t = threading.Thread(target=go)
    t.start()
    deadline = time.time() + 30
    while requests.get(f"http://{server}/metrics", timeout=10).json()["num_requests_running"] == 0:
        assert time.time() < deadline
        time.sleep(0.01)
    time.sleep(0.05)
    assert CTL.post(f"http://{server}/pause", timeout=30).json()["paused"]
    t.join(30)
    r = res["r"]
    assert r["finish_reason"] == "abort" and 0 < len(r["output_ids"]) < 500
    assert len(r["output_logprobs"]) == len(r["output_ids"])
    # a request sent while paused waits, then runs after /continue
    t2 = threading.Thread(
        target=lambda: res.__setitem__("r2", _generate(server, [5], max_new_tokens=2))
    )
    t2.start()
    time.sleep(0.3)
    assert "r2" not in res
    assert requests.get(f"http://{server}/metrics", timeout=10).json()["num_requests_waiting"] == 1
    CTL.post(f"http://{server}/continue", timeout=30)
    t2.join(30)
    assert len(res["r2"]["output_ids"]) == 2


def test_abort_request_by_rid_returns_partial_output(server):
    res: dict = {}

    def go():
        r = CTL.post(
            f"http://{server}/generate",
            json={
                "rid": "abort-me",
                "input_ids": [5, 6],
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            },
            timeout=60,
        )
        res["r"] = r.json()

    t = threading.Thread(target=go)
    t.start()
    deadline = time.time() + 30
    while not CTL.post(
        f"http://{server}/abort_request", json={"rid": "abort-me"}, timeout=10
    ).json()["success"]:
        assert time.time() < deadline
        time.sleep(0.01)
    t.join(30)
    assert res["r"]["finish_reason"] == "abort" and len(res["r"]["output_ids"]) < 500


def test_set_version_is_reported_with_tokens(server):
    assert (
        CTL.post(f"http://{server}/set_version", json={"version": 7}, timeout=10).json()["version"]
        == 7
    )
    try:
        r = _generate(server, [5, 6], max_new_tokens=3, ignore_eos=True)
        assert r["output_versions"] == [7, 7, 7]
        assert requests.get(f"http://{server}/version", timeout=10).json()["version"] == 7
    finally:
        CTL.post(f"http://{server}/set_version", json={"version": 0}, timeout=10)


def test_launch_bad_model_path_raises_with_log_tail(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code") as ei:
        launch_local_server(str(tmp_path / "missing-model"), timeout=60)
    msg = str(ei.value)
    tail = msg.split("ends with:", 1)[1]  # the server's own log, not our message
    assert "Traceback" in tail and "missing-model" in tail, msg


def test_launch_server_process_timeout_kills_process(tmp_path):
    import psutil

    pids = tmp_path / "pids"
    # a server that never becomes healthy, with a child of its own (same process group)
    script = f"echo $$ > {pids}; sleep 300 & echo $! >> {pids}; wait"
    with pytest.raises(TimeoutError, match="not healthy"):
        launch_server_process(["sh", "-c", script], "127.0.0.1:1", timeout=3.0)
    got = [int(x) for x in pids.read_text().split()]
    assert len(got) == 2, got
    for pid in got:  # the server and its child die (gone or a zombie awaiting its reaper)
        deadline = time.monotonic() + 10.0  # a loaded machine delivers SIGKILL late
        status = None
        while time.monotonic() < deadline:
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                status = None
            if status in (None, psutil.STATUS_ZOMBIE):
                break
            time.sleep(0.05)
        assert status in (None, psutil.STATUS_ZOMBIE), (pid, status)


async def test_chat_and_text_completions_with_tokenizer_in_process():
    """OpenAI endpoints on the shipped tiny base (tokenizer + chat template), in process."""
    from aiohttp.test_utils import TestClient, TestServer

    from areal.inference.server.app import LocalInferenceServer
    from areal.models.tiny import get_tiny_base_path

    path = get_tiny_base_path()
    torch.set_num_threads(1)
    srv = LocalInferenceServer.from_pretrained(path)
    client = TestClient(TestServer(srv.build_app()))
    await client.start_server()
    try:
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": msgs,
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": True,
                "return_token_ids": True,
            },
        )
        assert r.status == 200, await r.text()
        c = (await r.json())["choices"][0]
        ids = c["token_ids"]
        assert 0 < len(ids) <= 12 and len(c["logprobs"]["content"]) == len(ids)
        assert c["message"]["content"] == srv.tokenizer.decode(ids, skip_special_tokens=True)
        prompt_ids = c["prompt_token_ids"]
        # the same prompt through /v1/completions (token ids) gives the same greedy tokens
        r = await client.post(
            "/v1/completions",
            json={
                "prompt": prompt_ids,
                "max_tokens": 12,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert (await r.json())["choices"][0]["token_ids"] == ids
        r = await client.post(
            "/v1/completions", json={"prompt": "Q: 1+1?", "max_tokens": 3, "n": 2}
        )
        body = await r.json()
        assert r.status == 200 and len(body["choices"]) == 2
    finally:
        await client.close()


# ------------------------------------------------------------------------- authentication
def test_server_control_endpoints_without_run_secret_401_and_change_nothing(server):
    before = requests.get(f"http://{server}/version", timeout=10).json()["version"]
    for path, body in (
        ("/set_version", {"version": before + 5}),
        ("/pause", {}),
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
        ("/init_weights_update_group", {}),
        ("/abort_request", {"rid": "x"}),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(f"http://{server}{path}", json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (path, r.status_code, r.text)
    assert requests.get(f"http://{server}/version", timeout=10).json()["version"] == before
    assert not requests.get(f"http://{server}/is_paused", timeout=10).json()["is_paused"]
    # generation stays open when no API key is configured
    assert _generate(server, [5, 6], max_new_tokens=2)["output_ids"]


async def test_server_api_key_guards_generation_run_secret_guards_control(
    tiny_model_dir, monkeypatch
):
    from aiohttp.test_utils import TestClient, TestServer

    from areal.inference.server.app import LocalInferenceServer

    torch.set_num_threads(1)
    monkeypatch.setenv(SERVER_API_KEY_ENV, "sk-gen-key")
    srv = LocalInferenceServer.from_pretrained(tiny_model_dir)
    secret = get_run_secret()
    gen = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    async with TestClient(TestServer(srv.build_app())) as client:
        assert (await client.post("/generate", json=gen)).status == 401
        r = await client.post("/generate", json=gen, headers={"x-api-key": "sk-gen-key"})
        assert r.status == 200
        r = await client.post("/generate", json=gen, headers=auth_headers(secret))
        assert r.status == 200  # the controller's secret is accepted everywhere
        assert (await client.get("/health")).status == 200
        # the generation key is not a control key
        r = await client.post(
            "/set_version", json={"version": 3}, headers=auth_headers("sk-gen-key")
        )
        assert r.status == 401
        r = await client.post("/set_version", json={"version": 3}, headers=auth_headers(secret))
        assert r.status == 200 and srv.core.version == 3
