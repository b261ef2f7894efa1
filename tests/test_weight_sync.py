"""WeightSynchronizer on real components: a train controller (FSDPEngine worker on the
tiny model), a real built-in server and the RemoteLocalEngine client.

Checks the order pause -> hooks -> export -> push -> verify -> commit -> resume, that the
server then serves exactly the pushed weights, and that a failing export leaves the
servers generating, the versions unchanged and a clear error.
"""

from __future__ import annotations

import asyncio
import math
import os

import pytest
import requests
import torch
from _weight_sync_stack import PROMPT, actor_stack, train_step

from areal.api.cli_args import (
    GenerationHyperparameters,
    InferenceEngineConfig,
)
from areal.api.io_struct import ModelRequest, SaveLoadMeta, WeightUpdateMeta
from areal.infra.weight_sync import WeightSyncError, WeightSyncHook, WeightSynchronizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


class _Spy:
    """Delegates to ``target`` and logs ``"<name>.<method>"`` for every method call."""

    def __init__(self, target, name: str, log: list[str]):
        self._target, self._name, self._log = target, name, log

    def __getattr__(self, attr):
        value = getattr(self._target, attr)
        if not callable(value):
            return value

        def call(*a, **kw):
            self._log.append(f"{self._name}.{attr}")
            return value(*a, **kw)

        return call


class _RecordingHook(WeightSyncHook):
    def __init__(self, log: list[str]):
        self.log = log
        self.contexts = []
        self.errors = []

    def before_push(self, ctx):
        self.log.append("hook.before_push")
        self.contexts.append(ctx)

    def transform(self, ctx, meta):
        self.log.append("hook.transform")
        return meta

    def verify(self, ctx):
        self.log.append("hook.verify")

    def after_push(self, ctx):
        self.log.append("hook.after_push")

    def on_error(self, ctx, error):
        self.errors.append((ctx.version, error))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    from areal.inference.clients.local import RemoteLocalEngine

    root = tmp_path_factory.mktemp("wsync")
    with actor_stack(str(root), tiny_model_dir, "ws", timeout=180) as actor:
        engine = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=180, request_timeout=60))
        try:
            engine.launch_server({"model_path": tiny_model_dir, "num_servers": 1})
            engine.initialize(train_data_parallel_size=1)
            meta = WeightUpdateMeta.from_disk("ws", "t", str(root))
            actor.connect_engine(engine, meta)
            train_step(actor)  # the actor's weights now differ from what the server loaded
            yield actor, engine, meta
        finally:
            engine.destroy()
            engine.teardown_server()


def _server(engine, path: str):
    return requests.get(f"http://{engine.addresses[0]}{path}", timeout=10).json()


def _greedy(engine):
    g = GenerationHyperparameters(max_new_tokens=6, greedy=True)
    return asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))


def _hf_logprobs(model_dir: str, output: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(PROMPT) - 1 : -1]
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


# what a disk sync calls between the pause and the resume, in order
_HOOKS_TO_AFTER_PUSH = [
    "hook.before_push",
    "hook.transform",
    "actor.save",
    "rollout.update_weights_from_disk",
    "hook.verify",
    "rollout.commit_weights",
    "actor.set_version",
    "hook.after_push",
]


def test_weight_sync_order_hooks_versions_and_served_weights(stack, tiny_model_dir):
    actor, engine, meta = stack
    log: list[str] = []
    hook = _RecordingHook(log)
    sync = WeightSynchronizer(_Spy(actor, "actor", log), _Spy(engine, "rollout", log), meta)
    sync.add_hook(hook)

    stats = sync.sync(1, resume=False)

    # the built-in server takes full weights in flight: generation is never paused
    calls = [c for c in log if c not in ("rollout.get_version", "rollout.updates_in_flight")]
    assert calls == ["rollout.pause", *_HOOKS_TO_AFTER_PUSH]
    assert stats["weight_sync/in_flight"] == 1.0
    ctx = hook.contexts[0]
    assert (ctx.version, ctx.previous_version, ctx.reason) == (1, 0, "step")
    assert ctx.meta.path == meta.with_version(1).path
    assert stats["weight_sync/seconds"] >= stats["weight_sync/push_seconds"] > 0
    # Every side at version 1; generation resumed, the executor left paused.
    assert actor.get_version() == 1 and engine.get_version() == 1
    assert _server(engine, "/version")["version"] == 1
    assert _server(engine, "/is_paused")["is_paused"] is False
    assert engine.workflow_executor.is_paused
    sync.resume()
    assert not engine.workflow_executor.is_paused
    # The server now serves exactly the pushed weights (not the initial ones).
    resp = _greedy(engine)
    assert resp.output_versions == [1] * len(resp.output_tokens)
    pushed = _hf_logprobs(meta.with_version(1).path, resp.output_tokens)
    initial = _hf_logprobs(tiny_model_dir, resp.output_tokens)
    got = torch.tensor(resp.output_logprobs)
    torch.testing.assert_close(got, pushed, atol=1e-4, rtol=0)
    assert (got - initial).abs().max() > 1e-3


def test_weight_sync_pauses_generation_when_not_in_flight(stack):
    """``rollout.inflight_weight_updates=False`` (and vLLM / SGLang, LoRA adapters): the
    servers' generation is paused around the push and resumed after the commit."""
    actor, engine, meta = stack
    engine.config.inflight_weight_updates = False
    log: list[str] = []
    hook = _RecordingHook(log)
    sync = WeightSynchronizer(_Spy(actor, "actor", log), _Spy(engine, "rollout", log), meta)
    sync.add_hook(hook)
    try:
        stats = sync.sync(engine.get_version() + 1, resume=True)
    finally:
        engine.config.inflight_weight_updates = True
    calls = [c for c in log if c not in ("rollout.get_version", "rollout.updates_in_flight")]
    assert calls == [
        "rollout.pause",
        "rollout.pause_generation",
        *_HOOKS_TO_AFTER_PUSH,
        "rollout.continue_generation",
        "rollout.resume",
    ]
    assert stats["weight_sync/in_flight"] == 0.0
    assert _server(engine, "/is_paused")["is_paused"] is False


def test_weight_sync_failing_export_resumes_servers_keeps_versions_clear_error(stack):
    actor, engine, meta = stack
    log: list[str] = []
    hook = _RecordingHook(log)
    sync = WeightSynchronizer(actor, engine, meta, hooks=[hook])
    v_before = engine.get_version()
    bad = meta.with_version(v_before + 1).path
    os.makedirs(os.path.dirname(bad), exist_ok=True)
    with open(bad, "w") as f:  # a file where the weight directory should go: save fails
        f.write("not a directory")

    with pytest.raises(WeightSyncError, match=rf"version {v_before + 1} failed at 'export'") as ei:
        sync.sync(v_before + 1)
    assert ei.value.step == "export" and ei.value.__cause__ is not None
    assert hook.errors and hook.errors[0][0] == v_before + 1
    assert "hook.verify" not in log and "hook.after_push" not in log
    # Servers generate again, the executor is running, no side moved its version.
    assert _server(engine, "/is_paused")["is_paused"] is False
    assert not engine.is_paused() and not engine.workflow_executor.is_paused
    assert actor.get_version() == v_before == engine.get_version()
    assert _server(engine, "/version")["version"] == v_before
    resp = _greedy(engine)
    assert len(resp.output_tokens) == 6 and set(resp.output_versions) == {v_before}


def test_weight_sync_disk_deletes_older_version_dirs_keeps_current_and_others(stack):
    actor, engine, meta = stack
    sync = WeightSynchronizer(actor, engine, meta)
    v = engine.get_version() + 10  # clear of the versions other tests left behind
    root = os.path.dirname(meta.with_version(v + 1).path)
    os.makedirs(os.path.join(root, "notes"), exist_ok=True)  # not a version: kept

    sync.sync(v + 1)
    assert os.path.isdir(meta.with_version(v + 1).path)
    sync.sync(v + 2)

    # Only the current version's weights stay (one model copy, not one per step) ...
    kept = sorted(os.listdir(root))
    assert kept == sorted(["notes", f"v{v + 2}"])
    # ... and a restarted server is readmitted from it.
    path, version = sync.current_weights()
    assert version == v + 2 and path == meta.with_version(v + 2).path
    assert any(f.endswith(".safetensors") for f in os.listdir(path))
    assert _server(engine, "/version")["version"] == v + 2


class _DroppedOnce(WeightSyncHook):
    """A verification whose first request meets a dropped connection (a real one: a port
    nobody listens on), then checks the real server."""

    def __init__(self):
        self.calls = 0

    def verify(self, ctx):
        from areal.utils.network import find_free_ports

        self.calls += 1
        if self.calls == 1:
            requests.get(f"http://127.0.0.1:{find_free_ports(1)[0]}/x", timeout=5)
        assert _server(ctx.rollout, "/health")["status"] == "ok"


def test_weight_sync_verify_dropped_connection_retried_server_kept(stack):
    actor, engine, meta = stack
    hook = _DroppedOnce()
    sync = WeightSynchronizer(actor, engine, meta, hooks=[hook])
    v = engine.get_version() + 5  # not the version whose directory the push test spoiled

    sync.sync(v)

    assert hook.calls == 2  # a transport failure is no verdict on the weights: retried once
    assert engine.healthy_addresses == engine.addresses  # the server answers: it stays
    assert actor.get_version() == v == engine.get_version()
    assert _server(engine, "/version")["version"] == v


def _write_push_with_one_tensor_initial(push_dir: str, initial_dir: str, name: str, out: str):
    """Write to ``out`` the pushed weights of ``push_dir`` with ``name`` at its initial value
    (it must have moved in the push): what a server that skipped that tensor holds."""
    import glob

    from safetensors.torch import load_file, save_file

    pushed = {}
    for f in glob.glob(os.path.join(push_dir, "*.safetensors")):
        pushed.update(load_file(f))
    initial = load_file(os.path.join(initial_dir, "model.safetensors"))
    assert not torch.equal(pushed[name], initial[name])
    pushed[name] = initial[name]
    os.makedirs(out, exist_ok=True)
    save_file(pushed, os.path.join(out, "model.safetensors"))


class _SkipOneTensor(WeightSyncHook):
    """After the push, reload the server with the pushed weights except ``name``, which keeps
    its initial value: a server that silently skipped one tensor."""

    def __init__(self, initial_dir: str, name: str, scratch: str):
        self.initial_dir, self.name, self.scratch = initial_dir, name, scratch
        self.active = True

    def verify(self, ctx):
        if not self.active:
            return

        from areal.utils.auth import auth_headers, get_run_secret

        _write_push_with_one_tensor_initial(
            ctx.meta.path, self.initial_dir, self.name, self.scratch
        )
        for addr in ctx.rollout.addresses:
            r = requests.post(
                f"http://{addr}/update_weights_from_disk",
                json={"model_path": self.scratch, "version": ctx.version},
                headers=auth_headers(get_run_secret()),
                timeout=60,
            )
            assert r.status_code == 200, r.text


def test_weight_sync_fingerprint_hook_passes_real_push_catches_skipped_tensor(
    stack, tiny_model_dir, tmp_path
):
    from areal.infra.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch

    """The fingerprints asked for with a request after the push (``in_response=False``,
    as for xccl or servers that do not answer with the update): a server reloaded after
    the push with one tensor at its old value is caught."""
    actor, engine, meta = stack
    v = engine.get_version() + 5
    hook = WeightFingerprintHook(in_response=False)
    stats = WeightSynchronizer(actor, engine, meta, hooks=[hook]).sync(v)
    n_exported = sum(len(b) for b in actor.get_param_specs(1))
    assert stats["weight_sync/fingerprint_tensors"] == n_exported > 0
    assert stats["weight_sync/fingerprint_servers"] == 1
    assert "weight_sync/fingerprint_in_response_servers" not in stats
    assert engine.get_version() == v

    name = "model.layers.0.self_attn.q_proj.weight"
    hooks = [
        _SkipOneTensor(tiny_model_dir, name, str(tmp_path / "skip")),
        WeightFingerprintHook(in_response=False),
    ]
    with pytest.raises(WeightSyncError, match="failed at 'verify'") as ei:
        WeightSynchronizer(actor, engine, meta, hooks=hooks).sync(v + 1)
    cause = ei.value.__cause__
    assert isinstance(cause, WeightFingerprintMismatch)
    assert cause.server == engine.addresses[0] and len(cause.tensors) == 1
    assert cause.tensors[0].startswith(name) and name in str(ei.value)
    assert actor.get_version() == v  # the trainer's version did not move


def test_weight_sync_background_fingerprint_mismatch_refused_before_commit_naming_it(
    stack, tiny_model_dir, tmp_path
):
    """``background=True`` on the real stack: the commit waits for every check (design
    choice (b)), so a later sync whose server skipped a tensor is refused inside the sync,
    naming the server, the tensor and the version; the server stays at the previous
    version."""
    from areal.infra.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch

    actor, engine, meta = stack
    v = engine.get_version() + 10
    name = "model.layers.1.self_attn.q_proj.weight"
    skip = _SkipOneTensor(tiny_model_dir, name, str(tmp_path / "skip"))
    skip.active = False
    hook = WeightFingerprintHook(full_every=4, background=True, in_response=False)
    sync = WeightSynchronizer(actor, engine, meta, hooks=[skip, hook])
    assert sync.sync(v)["weight_sync/fingerprint_version"] == v
    assert sync.sync(v + 1)["weight_sync/fingerprint_version"] == v + 1
    skip.active = True
    with pytest.raises(WeightSyncError, match="failed at 'verify'") as ei:
        sync.sync(v + 2)
    err = ei.value.__cause__
    assert isinstance(err, WeightFingerprintMismatch)
    assert err.server == engine.addresses[0] and err.version == v + 2
    assert len(err.tensors) == 1 and err.tensors[0].startswith(name)
    assert name in str(ei.value) and engine.addresses[0] in str(ei.value)
    assert engine.get_version() == v + 1 == actor.get_version()
    assert _server(engine, "/version")["version"] == v + 1
    sync.flush()  # nothing left to check at the step boundary


class _SkipInLoad(WeightSyncHook):
    """The servers load the push with ``name`` at its initial value: the engine's disk update
    is pointed at a copy of the pushed directory (the trainer's fingerprint reference
    included) in which that tensor was not updated."""

    def __init__(self, initial_dir: str, name: str, scratch: str):
        self.initial_dir, self.name, self.scratch = initial_dir, name, scratch

    def before_push(self, ctx):
        import dataclasses
        import shutil

        from areal.infra.weights.fingerprint import REFERENCE_FILE

        engine, hook = ctx.rollout, self
        real = engine.update_weights_from_disk

        def update(meta):
            _write_push_with_one_tensor_initial(
                meta.path, hook.initial_dir, hook.name, hook.scratch
            )
            shutil.copy(os.path.join(meta.path, REFERENCE_FILE), hook.scratch)
            return real(dataclasses.replace(meta, path=hook.scratch))

        engine.update_weights_from_disk = update

    def verify(self, ctx):
        del ctx.rollout.update_weights_from_disk  # the engine's own method again


@pytest.mark.parametrize("background", [False, True])
def test_weight_sync_fingerprint_in_update_response_catches_tensor_skipped_by_load(
    stack, tiny_model_dir, tmp_path, background
):
    """Disk sync, fingerprints in the update response (the default): the trainer writes its
    reference next to the weights, the server returns its fingerprint with the update, and
    the check asks nothing more (no RPC to the trainer, no request to the server). A server
    whose load skips one tensor is caught in the sync, naming server, tensor and version;
    over ``full_every`` syncs the references take every large tensor in full once.
    ``background=True``: after the first check the file names only the seed, the trainer
    digests its export after the sync (``fingerprint_reference``, a checkpoint saved
    meanwhile changes nothing) and the check waits for it before the commit."""
    from areal.infra.weight_verify import WeightFingerprintHook, WeightFingerprintMismatch
    from areal.infra.weights.fingerprint import FULL_SAMPLE_MAX, read_reference

    actor, engine, meta = stack
    log: list[str] = []
    spy = _Spy(actor, "actor", log)
    every = 2
    hook = WeightFingerprintHook(full_every=every, background=background)
    asked = []
    hook.server_fingerprints = lambda *a, **k: asked.append(a)
    sync = WeightSynchronizer(spy, engine, meta, hooks=[hook])
    v = engine.get_version() + 30 + (40 if background else 0)
    shares = []
    for version in range(v, v + every):
        stats = sync.sync(version)
        # a checkpoint in between: no reference there, the rotation does not move
        ckpt = str(tmp_path / f"ckpt{version}")
        actor.save(SaveLoadMeta(path=ckpt, weight_format="hf", with_optim=False))
        assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
        assert read_reference(ckpt) is None
        assert stats["weight_sync/fingerprint_in_response_servers"] == 1
        assert stats["weight_sync/fingerprint_servers"] == 1
        assert stats["weight_sync/fingerprint_version"] == version
        ref = read_reference(meta.with_version(version).path)
        assert "deferred" not in ref  # background: completed by the trainer's thread
        shares.append(set(ref["full"]))
    assert "actor.weights_fingerprint" not in log and asked == []
    sizes = {s.name: math.prod(s.shape) for b in actor.get_param_specs(1) for s in b}
    assert set().union(*shares) == {n for n, k in sizes.items() if k > FULL_SAMPLE_MAX}
    assert sum(map(len, shares)) == len(set().union(*shares))  # each once

    name = "model.layers.1.mlp.up_proj.weight"
    skip = _SkipInLoad(tiny_model_dir, name, str(tmp_path / "skip"))
    sync = WeightSynchronizer(actor, engine, meta, hooks=[skip, hook])
    # background or not, the commit waits for the check: refused inside the sync
    with pytest.raises(WeightSyncError, match="failed at 'verify'") as ei:
        sync.sync(v + every)
    cause = ei.value.__cause__
    assert actor.get_version() == v + every - 1 and asked == []
    assert _server(engine, "/version")["version"] == v + every - 1
    assert isinstance(cause, WeightFingerprintMismatch) and cause.version == v + every
    assert cause.server == engine.addresses[0] and len(cause.tensors) == 1
    assert cause.tensors[0].startswith(name) and name in str(ei.value)


class _FakeActor:
    """An actor whose weights move with every ``train()`` (a counter stands for them)."""

    def __init__(self):
        self.weights = 0
        self.version = 0

    def train(self):
        self.weights += 1

    def update_weights(self, meta):  # xccl push: nothing to broadcast to in this test
        pass

    def set_version(self, version):
        self.version = version

    def save(self, meta):
        os.makedirs(meta.path, exist_ok=True)
        with open(os.path.join(meta.path, "weights.txt"), "w") as f:
            f.write(str(self.weights))


class _FakeRollout:
    healthy_addresses = ("127.0.0.1:1",)

    def __init__(self):
        self.version = 0
        self.readmitted = []

    def get_version(self):
        return self.version

    def set_version(self, version):
        self.version = version

    def pause(self):
        pass

    def resume(self):
        pass

    def commit_weights(self, version):
        self.version = version
        return []

    def rollback_weights(self, previous_path):
        return []

    def readmit_server(self, address, weights_path, version, replaces=None):
        with open(os.path.join(weights_path, "weights.txt")) as f:
            self.readmitted.append((address, version, int(f.read())))


class _RefuseOnce(WeightSyncHook):
    def __init__(self):
        self.armed = True

    def verify(self, ctx):
        if self.armed:
            self.armed = False
            raise RuntimeError("fingerprint mismatch (test)")


def test_weight_sync_xccl_readmit_after_refusal_never_serves_refused_weights(tmp_path):
    """xccl keeps no copy of a version on disk: after a refusal the actor holds the refused
    weights, so readmitting a server with "the current version" from the actor would serve
    them under the old version. It raises instead, and works again after the next commit."""
    actor, rollout = _FakeActor(), _FakeRollout()
    meta = WeightUpdateMeta(type="xccl")
    ws = WeightSynchronizer(
        actor,
        rollout,
        meta,
        hooks=[_RefuseOnce()],
        scratch_dir=str(tmp_path / "scratch"),
        max_consecutive_refusals=None,
    )
    actor.train()
    assert ws.sync(1)["weight_sync/refused"] == 1.0  # refused: servers stay on version 0
    actor.train()
    assert "weight_sync/refused" not in ws.sync(1)  # weights 2 are version 1 now
    assert rollout.get_version() == 1
    ws.hooks[0].armed = True
    actor.train()  # weights 3
    assert ws.sync(2)["weight_sync/refused"] == 1.0
    assert rollout.get_version() == 1
    with pytest.raises(RuntimeError, match="refused at the last sync"):
        ws.readmit("127.0.0.1:2")
    assert rollout.readmitted == []
    actor.train()  # weights 4
    ws.sync(2)
    ws.readmit("127.0.0.1:2")
    assert rollout.readmitted == [("127.0.0.1:2", 2, 4)]


def _consume(sm, n: int) -> None:
    """``n`` rollouts started, finished and accepted (a batch the trainer then consumes)."""
    for _ in range(n):
        sm.on_rollout_enqueued()
        sm.on_rollout_submitted()
        sm.on_rollout_accepted()


def test_refused_sync_counts_in_the_staleness_bound_so_the_next_batch_can_start(tmp_path):
    """With max_head_offpolicyness = 0 the next batch starts only at the next version. A
    refused sync consumed a batch but moved no version: unless the bound counts it, no
    rollout for the next step can ever start (the run waited forever in CI after a server
    died during an xccl push)."""
    from areal.infra.rollout.staleness_manager import StalenessManager

    actor, rollout = _FakeActor(), _FakeRollout()
    sm = StalenessManager(100, consumer_batch_size=4, max_staleness=0, version_provider=rollout)
    rollout.staleness_manager = sm
    ws = WeightSynchronizer(
        actor, rollout, WeightUpdateMeta(type="xccl"), hooks=[_RefuseOnce()],
        scratch_dir=str(tmp_path / "scratch"), max_consecutive_refusals=None,
    )  # fmt: skip
    _consume(sm, 4)  # step 1's batch, generated at version 0
    assert sm.get_capacity() == 0  # synchronous: the next batch waits for version 1
    actor.train()
    assert ws.sync(1)["weight_sync/refused"] == 1.0
    assert rollout.get_version() == 0 and sm.get_capacity() == 4  # step 2's batch starts
    _consume(sm, 4)
    actor.train()
    assert "weight_sync/refused" not in ws.sync(2)
    # version 2 = two consumed batches again: the credit ended with version 0
    assert rollout.get_version() == 2 and sm.get_capacity() == 4
