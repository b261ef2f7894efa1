"""A refused weight sync never leaves a refused version live (real servers, real trainer).

Stack: a train controller with one FSDPEngine worker (tiny model), three built-in servers
(``A``, ``B``: the tiny model; ``C``: a model with other shapes, whose loads fail half-way)
and ``RemoteLocalEngine`` clients over ``[A]``, ``[A, B]`` and ``[A, C]``.

For ``disk`` and ``xccl``, with one and two servers: a server that skips a tensor in the
load (the fingerprint check refuses), and a push that fails on one server of two, leave
every server at the previous ``/get_version`` serving greedy logprobs equal to
transformers' on the previous checkpoint; the run continues (``weight_sync/refused``) and
the next sync of the same version succeeds; ``max_consecutive_refusals`` stops the run
with an error naming the version, the server and the tensor.
"""

from __future__ import annotations

import glob
import os

import pytest
import requests
import torch
from _weight_sync_stack import PROMPT, actor_stack, train_step

from areal.api.cli_args import (
    InferenceEngineConfig,
)
from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal.infra.weights.weight_sync import (
    WeightSyncHook,
    WeightSynchronizer,
    WeightSyncStopped,
)
from areal.infra.weights.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch
from areal.utils.auth import auth_headers, get_run_secret

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SKIPPED = "model.layers.0.self_attn.q_proj.weight"


def _odd_model(path: str, like: str) -> str:
    """The tiny model with another MLP width: loads of the tiny model's weights fail on it
    half-way (after the tensors before the first MLP were copied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(like)
    cfg.intermediate_size = cfg.intermediate_size + 8
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    from areal.inference.clients.local import RemoteLocalEngine

    root = tmp_path_factory.mktemp("refusal")
    odd = _odd_model(str(root / "odd"), tiny_model_dir)
    with actor_stack(str(root), tiny_model_dir, "rf", timeout=240) as actor:
        launcher = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=240))
        engines = {}
        try:
            (a,) = launcher.launch_server({"model_path": tiny_model_dir})
            (b,) = launcher.launch_server({"model_path": tiny_model_dir})
            (c,) = launcher.launch_server({"model_path": odd})
            for name, addrs in (("A", [a]), ("AB", [a, b]), ("AC", [a, c])):
                eng = RemoteLocalEngine(
                    InferenceEngineConfig(setup_timeout=240, request_timeout=120)
                )
                eng.initialize(addr=addrs, train_data_parallel_size=1)
                engines[name] = eng
            yield {
                "actor": actor,
                "engines": engines,
                "root": str(root),
                "initial": {a: tiny_model_dir, b: tiny_model_dir, c: odd},
                "a": a,
                "b": b,
                "c": c,
            }
        finally:
            for eng in engines.values():
                eng.destroy()
            launcher.teardown_server()


# --------------------------------------------------------------------------- helpers
def _version(addr: str) -> int:
    return requests.get(f"http://{addr}/get_version", timeout=30).json()["version"]


def _served(addr: str) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of PROMPT by the server at ``addr`` and its logprobs."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "greedy": True, "ignore_eos": True},
    }
    r = requests.post(f"http://{addr}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return list(out["output_ids"]), torch.tensor(out["output_logprobs"])


def _hf_logprobs(model_dir: str, output: list[int]) -> torch.Tensor:
    from _hf_reference import hf_logprobs, hf_model

    return hf_logprobs(hf_model(model_dir), PROMPT, output)


def _assert_serves(addr: str, version: int, model_dir: str) -> None:
    """``addr`` answers ``version`` and serves exactly the weights of ``model_dir``."""
    assert _version(addr) == version
    tokens, got = _served(addr)
    torch.testing.assert_close(got, _hf_logprobs(model_dir, tokens), atol=1e-4, rtol=0)


def _load_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        out.update(load_file(f))
    return out


class _SkipOnServer(WeightSyncHook):
    """After the push, reload one server with the pushed weights except ``SKIPPED``, which
    keeps the server's previous value (loaded under the pending version, as the push was):
    a server whose load silently skipped one tensor."""

    def __init__(self, addr: str, previous_dir: str, scratch: str):
        self.addr, self.previous_dir, self.scratch = addr, previous_dir, scratch
        self.active = True

    def verify(self, ctx):
        from safetensors.torch import save_file

        if not self.active:
            return
        src = ctx.meta.path
        if ctx.meta.type == "xccl":  # nothing on disk: what the trainer just broadcast
            src = os.path.join(self.scratch, "pushed")
            ctx.actor.save(SaveLoadMeta(path=src, weight_format="hf", with_optim=False))
        pushed = _load_dir(src)
        previous = _load_dir(self.previous_dir)
        assert not torch.equal(pushed[SKIPPED], previous[SKIPPED])
        pushed[SKIPPED] = previous[SKIPPED]
        out = os.path.join(self.scratch, "skipped")
        os.makedirs(out, exist_ok=True)
        save_file(pushed, os.path.join(out, "model.safetensors"))
        r = requests.post(
            f"http://{self.addr}/update_weights_from_disk",
            json={"model_path": out, "version": ctx.version},
            headers=auth_headers(get_run_secret()),
            timeout=120,
        )
        assert r.status_code == 200, r.text


def _meta(stack, mode: str, engine) -> WeightUpdateMeta:
    actor = stack["actor"]
    if mode == "disk":
        meta = WeightUpdateMeta.from_disk("rf", "t", stack["root"], name=f"disk-{id(engine)}")
    else:
        from areal.utils.network import find_free_ports

        meta = WeightUpdateMeta(
            type="xccl",
            master_port=find_free_ports(1)[0],
            group_name=f"rf-{id(engine)}",
            timeout_s=60.0,
        )
        actor.weight_update_group_initialized = False
    actor.connect_engine(engine, meta)
    return meta


def _current_dir(stack, sync: WeightSynchronizer, mode: str, addr: str, tmp) -> str:
    """A directory with the weights ``addr`` serves now (its previous checkpoint)."""
    version = sync.rollout.get_version()
    if version == 0:
        return stack["initial"][addr]
    if mode == "disk":
        return sync.meta.with_version(version).path
    path = str(tmp / f"served-v{version}")
    if not os.path.isdir(path):
        stack["actor"].save(SaveLoadMeta(path=path, weight_format="hf", with_optim=False))
    return path


# --------------------------------------------------------------------------- tests
def _refused_verify_then_retry(stack, mode: str, servers: str, tmp_path) -> None:
    actor, engine = stack["actor"], stack["engines"][servers]
    addrs = list(engine.addresses)
    meta = _meta(stack, mode, engine)
    skip = _SkipOnServer(addrs[-1], "", str(tmp_path / "skip"))
    sync = WeightSynchronizer(
        actor,
        engine,
        meta,
        hooks=[skip, WeightFingerprintHook(in_response=False)],
        max_consecutive_refusals=3,
    )
    base = max(_version(a) for a in addrs)
    sync.set_version(base)  # every side agrees before the test ...
    skip.active = False
    train_step(actor)
    sync.sync(base + 1)  # ... and every server holds the same weights
    for round_ in range(2):  # a refusal at version v and, after a good sync, at v + 1
        v = engine.get_version()
        previous = {a: _current_dir(stack, sync, mode, a, tmp_path) for a in addrs}
        skip.previous_dir, skip.active = previous[addrs[-1]], True
        train_step(actor)

        stats = sync.sync(v + 1)

        assert stats["weight_sync/refused"] == 1.0
        assert stats["weight_sync/consecutive_refusals"] == 1.0
        err = sync.last_refusal.__cause__
        assert isinstance(err, WeightFingerprintMismatch) and err.server == addrs[-1]
        assert err.tensors[0].startswith(SKIPPED)
        # every server: the previous version, serving exactly the previous weights
        assert engine.get_version() == v and actor.get_version() == v
        for a in addrs:
            _assert_serves(a, v, previous[a])
        # the run continues: the next sync of that version succeeds everywhere
        skip.active = False
        stats = sync.sync(v + 1)
        assert "weight_sync/refused" not in stats and sync.consecutive_refusals == 0
        assert engine.get_version() == v + 1 == actor.get_version()
        pushed = _current_dir(stack, sync, mode, addrs[0], tmp_path)
        for a in addrs:
            _assert_serves(a, v + 1, pushed)
        assert v + 1 == base + 2 + round_


def test_refused_verify_disk_one_server_rolls_back_then_next_sync_succeeds(stack, tmp_path):
    _refused_verify_then_retry(stack, "disk", "A", tmp_path)


def test_refused_verify_disk_two_servers_rolls_back_both(stack, tmp_path):
    _refused_verify_then_retry(stack, "disk", "AB", tmp_path)


def test_refused_verify_xccl_one_server_rolls_back_then_next_sync_succeeds(stack, tmp_path):
    _refused_verify_then_retry(stack, "xccl", "A", tmp_path)


def test_refused_verify_xccl_two_servers_rolls_back_both(stack, tmp_path):
    _refused_verify_then_retry(stack, "xccl", "AB", tmp_path)


@pytest.mark.parametrize("mode", ["disk", "xccl"])
def test_push_failing_on_one_of_two_servers_leaves_both_on_previous_weights(stack, tmp_path, mode):
    """Server C cannot hold the tiny model's shapes: its load fails half-way (HTTP 400)
    after A loaded everything. Both roll back: A to the previous checkpoint, C to its own
    model (the tensors it had already copied are restored)."""
    actor, engine = stack["actor"], stack["engines"]["AC"]
    a, c = stack["a"], stack["c"]
    meta = _meta(stack, mode, engine)
    sync = WeightSynchronizer(actor, engine, meta, max_consecutive_refusals=None)
    previous = dict(stack["initial"])
    for x in (a, c):  # A back on the initial model (earlier tests moved it); C never moves
        r = requests.post(
            f"http://{x}/update_weights_from_disk",
            json={"model_path": previous[x]},
            headers=auth_headers(get_run_secret()),
            timeout=120,
        )
        assert r.status_code == 200, r.text
    v = max(_version(x) for x in (a, c))
    sync.set_version(v)
    train_step(actor)

    stats = sync.sync(v + 1)

    assert stats["weight_sync/refused"] == 1.0 and sync.last_refusal.step == "push"
    assert c in str(sync.last_refusal)
    assert engine.get_version() == v == actor.get_version()
    assert sorted(engine.healthy_addresses) == sorted([a, c])  # both rolled back, kept
    for x in (a, c):
        _assert_serves(x, v, previous[x])


def test_consecutive_refusals_stop_naming_version_server_tensor(stack, tmp_path):
    actor, engine = stack["actor"], stack["engines"]["A"]
    a = stack["a"]
    meta = _meta(stack, "disk", engine)
    v = max(_version(a), engine.get_version())
    skip = _SkipOnServer(a, "", str(tmp_path / "skip"))
    sync = WeightSynchronizer(
        actor,
        engine,
        meta,
        hooks=[skip, WeightFingerprintHook(in_response=False)],
        max_consecutive_refusals=2,
    )
    sync.set_version(v)
    skip.active = False
    train_step(actor)
    sync.sync(v + 1)  # the server holds the actor's weights (previous checkpoint)
    v += 1
    previous = _current_dir(stack, sync, "disk", a, tmp_path)
    skip.previous_dir, skip.active = previous, True
    train_step(actor)
    assert sync.sync(v + 1)["weight_sync/refused"] == 1.0  # the first: the run goes on

    with pytest.raises(WeightSyncStopped) as ei:
        sync.sync(v + 1)

    err = ei.value
    assert (err.version, err.server, err.step, err.refusals) == (v + 1, a, "verify", 2)
    assert err.tensor.startswith(SKIPPED)
    msg = str(err)
    assert f"version {v + 1}" in msg and a in msg and SKIPPED in msg
    _assert_serves(a, v, previous)
    assert not engine.is_paused() and not engine.workflow_executor.is_paused


def test_max_consecutive_refusals_config_validated():
    with pytest.raises(ValueError, match="max_consecutive_weight_sync_refusals"):
        InferenceEngineConfig(max_consecutive_weight_sync_refusals=-1)
    assert InferenceEngineConfig().max_consecutive_weight_sync_refusals == 3
    with pytest.raises(ValueError, match="max_consecutive_refusals"):
        WeightSynchronizer(None, None, None, max_consecutive_refusals=-2)
