"""The backend registry, server commands from config fields, and the trainer speaking the
allocation's backend.

The protocol tests start recording stand-ins of vLLM / SGLang (``_fake_inference_server.py``)
through the trainer's own start-up code (``PPOTrainer._start_rollout``) and a real
``LocalScheduler``: the vLLM one through ``AREAL_VLLM_PYTHON`` (an interpreter shim), the
SGLang one as a ``sglang.launch_server`` module on ``PYTHONPATH``. They record the command
line they were started with and every request the client sends.
"""

from __future__ import annotations

import os
import shlex
import sys
import types

import pytest
from _jsonl import read_jsonl

from areal.api.alloc_mode import AllocationMode
from areal.api.cli_args import GenerationHyperparameters, PPOConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.inference import backends as ib
from areal.inference.clients.local import LocalBackend, RemoteLocalEngine
from areal.inference.clients.sglang import RemoteSGLangEngine, SGLangBackend
from areal.inference.clients.vllm import RemotevLLMEngine, VLLMBackend
from areal.infra.remote_inf_engine import RemoteInfEngine

FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fake_inference_server.py")


def _config(model_path: str = "/models/m") -> PPOConfig:
    c = PPOConfig()
    c.actor.path = model_path
    c.seed = 7
    c.vllm.max_num_seqs = 7
    c.vllm.enforce_eager = True
    c.vllm.dtype = "float32"
    c.vllm.max_model_len = 256
    c.sglang.mem_fraction_static = 0.5
    c.sglang.dtype = "float32"
    c.cluster.n_gpus_per_node = 0
    c.rollout.setup_timeout = 60
    c.rollout.request_timeout = 30
    return c


def _flags(cmd: str) -> list[str]:
    return shlex.split(cmd)


# ------------------------------------------------------------------ registry
def test_registry_backend_name_maps_to_engine_and_adapter():
    assert ib.available_backends() == ["local", "sglang", "vllm"]
    assert ib.engine_class("local") is RemoteLocalEngine
    assert ib.engine_class("vllm") is RemotevLLMEngine
    assert ib.engine_class("sglang") is RemoteSGLangEngine
    assert isinstance(ib.make_adapter("local"), LocalBackend)
    assert isinstance(ib.make_adapter("vllm"), VLLMBackend)
    assert isinstance(ib.make_adapter("sglang"), SGLangBackend)


def test_registry_unknown_backend_raises_naming_allowed():
    with pytest.raises(ValueError, match="'tgi'.*local, sglang, vllm"):
        ib.engine_class("tgi")


def test_remote_inf_engine_without_adapter_raises_type_error():
    with pytest.raises(TypeError, match="BackendAdapter"):
        RemoteInfEngine()


def test_server_command_vllm_flags_from_config_fields(monkeypatch):
    monkeypatch.setenv("AREAL_VLLM_PYTHON", "/venvs/vllm/bin/python")
    cmd, env = ib.server_command("vllm", _config(), tp_size=2)
    argv = _flags(cmd)
    assert argv[:3] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for piece in (
        "--model /models/m",
        "--max-num-seqs 7",
        "--dtype float32",
        "--max-model-len 256",
        "--tensor-parallel-size 2",
        "--seed 1",
        "--host {host}",
        "--port {port}",
        "--logprobs-mode processed_logprobs",
        "--worker-extension-cls areal_vllm_worker_ext.ArealWorkerExtension",
    ):
        assert piece in joined, piece
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    assert "--swap-space" not in argv  # refused by vLLM's V1 server
    assert "--block-size 32" in joined  # n_gpus_per_node=0: vLLM CPU needs multiples of 32
    assert "--no-enable-chunked-prefill" in argv  # seeded requests + chunked prefill crash it
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("inference", "vllm_ext"))


def test_server_command_sglang_flags_from_config_fields():
    cmd, env = ib.server_command("sglang", _config(), tp_size=2)
    joined = " ".join(_flags(cmd))
    assert joined.startswith("python -m sglang.launch_server")
    for piece in (
        "--model-path /models/m",
        "--mem-fraction-static 0.5",
        "--dtype float32",
        "--tp-size 2",
        "--disable-radix-cache",
    ):
        assert piece in joined, piece


def test_server_command_local_uses_actor_model_dtype_seed():
    c = _config()
    c.actor.dtype = "float32"
    cmd, env = ib.server_command("local", c)
    assert _flags(cmd)[:3] == ["python", "-m", "areal.inference.server"]
    assert "--model-path /models/m --dtype float32 --seed 7" in cmd
    with pytest.raises(ValueError, match="tp_size=2"):
        ib.server_command("local", c, tp_size=2)


def test_server_command_braces_in_values_survive_scheduler_format():
    args = {"model": "/m", "hf_overrides": '{"a": 1}'}
    cmd, _ = RemotevLLMEngine.build_server_command(args)
    argv = [a.format(host="h", port=1) for a in shlex.split(cmd)]
    assert argv[argv.index("--hf-overrides") + 1] == '{"a": 1}'
    assert argv[argv.index("--host") + 1] == "h"


# ------------------------------------------------------------------ trainer -> fake servers
def _records(path: str) -> list[dict]:
    return read_jsonl(path)


@pytest.fixture
def fake_backends(tmp_path, monkeypatch):
    """Make 'vllm' and 'sglang' server commands start the recording stand-in."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("AREAL_FAKE_SERVER_RECORD", str(record))
    shim = tmp_path / "vllm-python"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} --kind vllm "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("AREAL_VLLM_PYTHON", str(shim))
    pkg = tmp_path / "fakepkgs" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        f"import runpy, sys\nsys.argv = [{FAKE!r}, '--kind', 'sglang'] + sys.argv[1:]\n"
        f"runpy.run_path({FAKE!r}, run_name='__main__')\n"
    )
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(tmp_path / "fakepkgs"), os.environ.get("PYTHONPATH", "")]),
    )
    return record


def _start_through_trainer(tmp_path, alloc: str):
    from areal.infra.scheduler.local import LocalScheduler
    from areal.trainer.rl_trainer import PPOTrainer

    sched = LocalScheduler(fileroot=str(tmp_path / "sched"), startup_timeout=60)
    fake_trainer = types.SimpleNamespace(
        config=_config(), alloc_mode=AllocationMode.from_str(alloc), scheduler=sched
    )
    try:
        engine = PPOTrainer._start_rollout(fake_trainer)
    except BaseException:
        sched.delete_workers(None)
        raise
    return sched, engine


async def _generate(engine, ids):
    g = GenerationHyperparameters(max_new_tokens=3, greedy=True)
    return await engine.agenerate(ModelRequest(rid="r1", input_ids=ids, gconfig=g))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alloc", ["vllm:d1+fsdp:d1", "sglang:d1+fsdp:d1"])
def test_trainer_launches_and_speaks_allocation_backend(tmp_path, fake_backends, alloc):
    import asyncio

    backend = alloc.split(":")[0]
    sched, engine = _start_through_trainer(tmp_path, alloc)
    try:
        assert type(engine) is ib.engine_class(backend)
        resp = asyncio.run(_generate(engine, [5, 6, 7]))
        assert resp.output_tokens == [8, 9, 10]
        assert resp.output_logprobs == [-0.5, -0.5, -0.5]
        assert resp.output_versions == [0, 0, 0]
        meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "w1"), version=1)
        # what WeightSynchronizer does around a disk push: pause, load (pending), commit,
        # continue; the client's load neither pauses nor moves the version itself
        engine.pause_generation()
        engine.update_weights_from_disk(meta).result(timeout=30)
        assert engine.get_version() == 0
        assert engine.commit_weights(1) == []
        assert engine.get_version() == 1
        engine.continue_generation()
    finally:
        engine.destroy()
        sched.delete_workers(None)

    recs = _records(str(fake_backends))
    start = recs[0]
    assert start["kind"] == backend
    argv = " ".join(start["argv"])
    reqs = [r for r in recs[1:] if r.get("path") not in (None, "/health")]
    paths = [r["path"] for r in reqs]
    if backend == "vllm":
        assert "--max-num-seqs 7" in argv and "--enforce-eager" in argv
        assert "--model /models/m" in argv and "--dtype float32" in argv
        assert start["env"]["VLLM_SERVER_DEV_MODE"] == "1"
        gen = reqs[0]
        assert gen["path"] == "/v1/completions"
        assert gen["body"]["prompt"] == [5, 6, 7]
        assert gen["body"]["max_tokens"] == 3 and gen["body"]["temperature"] == 0.0
        assert gen["body"]["logprobs"] == 0 and gen["body"]["return_tokens_as_token_ids"]
        assert paths[1:] == ["/pause", "/collective_rpc", "/resume"]
        assert reqs[1]["query"] == {"mode": "abort"}
        rpc = reqs[2]["body"]
        assert rpc["method"] == "areal_reload_weights"
        assert rpc["kwargs"] == {"weights_path": str(tmp_path / "w1")}
    else:
        assert "--model-path /models/m" in argv and "--mem-fraction-static 0.5" in argv
        gen = reqs[0]
        assert gen["path"] == "/generate"
        assert gen["body"]["input_ids"] == [5, 6, 7]
        assert gen["body"]["sampling_params"]["max_new_tokens"] == 3
        assert gen["body"]["return_logprob"] is True
        assert paths[1:] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert reqs[2]["body"]["model_path"] == str(tmp_path / "w1")


# ------------------------------------------------------------------ as_controller
class _EchoWorkflow:
    """Generates 2 greedy tokens and records their count as the reward."""

    async def arun_episode(self, engine, data):
        from areal.utils import stats_tracker

        g = GenerationHyperparameters(max_new_tokens=2, greedy=True)
        resp = await engine.agenerate(ModelRequest(input_ids=data["ids"], gconfig=g))
        stats_tracker.get("rollout").scalar(reward=float(len(resp.output_tokens)))
        return {"tokens": resp.output_tokens}


@pytest.mark.timeout(120)
def test_as_controller_vllm_starts_server_submit_wait_export_stats(tmp_path, fake_backends):
    from areal.api.cli_args import vLLMConfig
    from areal.api.workflow_api import RolloutWorkflow
    from areal.infra.controller.rollout_controller import RolloutController
    from areal.infra.scheduler.local import LocalScheduler

    wf = type("EchoWorkflow", (_EchoWorkflow, RolloutWorkflow), {})()
    c = _config()
    c.rollout.backend = "vllm:d1"
    c.rollout.max_head_offpolicyness = int(1e12)  # evaluation: no staleness bound
    sched = LocalScheduler(fileroot=str(tmp_path / "sched"), startup_timeout=60)
    rollout = RemotevLLMEngine.as_controller(c.rollout, sched)
    assert isinstance(rollout, RolloutController)
    try:
        args = vLLMConfig.build_args(vllm_config=c.vllm, tp_size=1, pp_size=1)
        args["model"] = "/models/eval"
        rollout.initialize(role="eval-rollout", server_args=args)
        for i in range(3):
            rollout.submit({"ids": [10 + i, 20 + i]}, workflow=wf)
        results = rollout.wait(3, timeout=60)
        stats = rollout.export_stats()
    finally:
        rollout.destroy()
        sched.delete_workers(None)
    assert sorted(r["tokens"] for r in results) == [[21, 22], [22, 23], [23, 24]]
    assert stats["rollout/reward"] == 2.0
    recs = _records(str(fake_backends))
    argv = " ".join(recs[0]["argv"])
    assert "--model /models/eval" in argv and "--swap-space" not in argv
    assert sum(r.get("path") == "/v1/completions" for r in recs) == 3
