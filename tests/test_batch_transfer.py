"""The batch crosses to each role's workers once per step: worker-held batches
(``BatchStore`` / ``BatchRef``), counted by the RPC layer's traffic counters, and freed."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from areal.api.cli_args import PPOConfig, TeacherConfig
from areal.api.scheduler_api import RemoteCallError
from areal.infra.controller import BatchRef, start_train_controller
from areal.infra.rpc.batch_store import STORE_ENGINE, BatchStore, StoredBatch
from areal.infra.rpc.rpc_server import EngineHost
from areal.infra.rpc.serialization import deserialize, serialize
from areal.infra.rpc.traffic import RPC_TRAFFIC
from areal.infra.scheduler import LocalScheduler
from areal.trainer.rl_step import PPORoles, train_on_batch

DIST = "tests._rpc_engines.DistTestEngine"
STUB = "tests._batch_engines.StubPPOEngine"


def _batch(lens: list[int], T: int = 16) -> dict:
    lens_t = torch.tensor(lens)
    B = len(lens)
    mask = (torch.arange(T)[None] < lens_t[:, None]).long()
    loss_mask = mask * (torch.arange(T)[None] >= 2).long()
    return {
        "input_ids": (torch.arange(B * T).reshape(B, T) + 1) * mask,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "logprobs": -0.01 * torch.arange(B * T).reshape(B, T).float() * loss_mask,
        "versions": torch.zeros(B, T, dtype=torch.long),
        "rewards": torch.arange(B).float() - B / 2,
    }


def _nbytes(batch: dict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))


def _host_call(host: EngineHost, method: str, *args, engine_name: str = "default"):
    payload = {"method": method, "args": args, "kwargs": {}, "engine_name": engine_name}
    status, body = host.run("call", serialize(payload))
    return status, deserialize(body)


# ------------------------------------------------------------------ worker side
def test_engine_host_resolves_handles_keeps_batch_results_and_frees():
    host = EngineHost()
    host.engines["default"] = __import__("_batch_engines").StubPPOEngine({})
    b = _batch([5, 9, 3, 7])
    assert _host_call(host, "put", "r1", b, engine_name=STORE_ENGINE)[0] == 200
    # a tensor result comes back; the handle stood for the batch
    status, out = _host_call(host, "compute_logp", StoredBatch("r1"))
    assert status == 200 and torch.equal(
        out["result"], b["input_ids"].float() * 0.01 * b["attention_mask"]
    )
    assert out["exec_s"] >= 0.0
    # store_as: kept on the worker, None goes back
    status, out = _host_call(host, "compute_logp", StoredBatch("r1", store_as="prox_logp"))
    assert status == 200 and out["result"] is None
    assert "prox_logp" in host.store.get("r1")
    # a method returning a batch (in place) answers with the handle, not the tensors
    status, out = _host_call(host, "compute_advantages", StoredBatch("r1"))
    assert out["result"] == StoredBatch("r1") and len(serialize(out)) < 400
    assert torch.equal(host.store.get("r1")["advantages"], b["rewards"][:, None] * b["loss_mask"])
    info = _host_call(host, "info", engine_name=STORE_ENGINE)[1]["result"]
    assert info["n_batches"] == 1 and info["bytes"] > _nbytes(b)
    assert _host_call(host, "free", "r1", engine_name=STORE_ENGINE)[1]["result"] is True
    assert _host_call(host, "info", engine_name=STORE_ENGINE)[1]["result"]["n_batches"] == 0
    # a freed handle is an error naming it
    status, out = _host_call(host, "compute_logp", StoredBatch("r1"))
    assert status == 500 and out["error_type"] == "KeyError" and "'r1'" in out["error"]
    status, out = _host_call(host, "_batches", engine_name=STORE_ENGINE)
    assert status == 404


def test_batch_store_copy_result_replaces_stored_batch():
    store = BatchStore()
    store.put("a", _batch([4, 4]))
    result = dict(store.get("a"), extra=torch.ones(2))
    assert store.keep_result(StoredBatch("a"), result) == StoredBatch("a")
    assert "extra" in store.get("a")
    assert store.keep_result(StoredBatch("a"), {"loss": 1.0}) == {"loss": 1.0}
    store.update("a", {"ref_logp": torch.zeros(2, 16)})
    assert set(store.fetch("a", ["ref_logp", "missing"])) == {"ref_logp"}
    assert store.free("a") and not store.free("a")


# ------------------------------------------------------------------ real workers
@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    s = LocalScheduler(
        fileroot=str(tmp_path_factory.mktemp("bt")), startup_timeout=120, call_timeout=120
    )
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def dist_ctrl(sched):
    c = start_train_controller(DIST, None, sched, "dist", world_size=2)
    yield c
    c.destroy()


def test_ref_results_equal_plain_dict_results_and_ref_is_freed(dist_ctrl):
    b = _batch([12, 1, 7, 3, 9, 2, 5, 11])
    plain_logp = dist_ctrl.forward_batch(b)
    plain_adv = dist_ctrl.compute_advantages(dict(b))["advantages"]
    plain_stats = dist_ctrl.train_batch(b, None, None)
    with dist_ctrl.put_batch(b) as ref:
        assert isinstance(ref, BatchRef) and ref.batch_size == 8
        assert torch.equal(dist_ctrl.forward_batch(ref), plain_logp)  # original order
        assert dist_ctrl.compute_advantages(ref) is ref  # stayed on the workers
        torch.testing.assert_close(ref.fetch(["advantages"])["advantages"], plain_adv)
        # reads like a dict (each read fetches from the workers), rows in the original order
        assert "advantages" in ref and set(ref.keys()) >= set(b) | {"advantages"}
        assert torch.equal(ref["input_ids"], b["input_ids"]) and ref.get("nope") is None
        with pytest.raises(KeyError, match="nope"):
            ref["nope"]
        as_dict = dict(ref.items())
        assert torch.equal(as_dict["rewards"], b["rewards"]) and as_dict["adv_rank"] == 0
        assert dist_ctrl.train_batch(ref, None, None) == plain_stats
        held = dist_ctrl.stored_batches()
        assert [h["n_batches"] for h in held] == [1, 1] and all(h["bytes"] > 0 for h in held)
    assert ref.freed and [h["n_batches"] for h in dist_ctrl.stored_batches()] == [0, 0]
    with pytest.raises(RuntimeError, match="freed"):
        dist_ctrl.forward_batch(ref)


def test_ref_and_plain_batch_mixed_or_store_as_without_ref_raise(dist_ctrl):
    b = _batch([3, 4])
    with dist_ctrl.put_batch(b) as ref:
        with pytest.raises(ValueError, match="BatchRef and a plain batch"):
            dist_ctrl.custom_function_call("forward_batch", ref, extra=b)
    with pytest.raises(ValueError, match="_store_as needs a BatchRef"):
        dist_ctrl.forward_batch(b, _store_as="x")


def test_worker_receives_batch_once_then_only_handles(dist_ctrl):
    b = _batch([16] * 8, T=256)
    RPC_TRAFFIC.reset()
    with dist_ctrl.put_batch(b) as ref:
        dist_ctrl.forward_batch(ref, _store_as="logp")
        dist_ctrl.compute_advantages(ref)
        dist_ctrl.train_batch(ref, None, None)
    t = RPC_TRAFFIC.snapshot()
    puts = {w: v for (w, m), v in t.items() if m == "store.put"}
    assert sorted(puts) == ["dist/0", "dist/1"] and all(v.calls == 1 for v in puts.values())
    assert sum(v.bytes_sent for v in puts.values()) >= _nbytes(b)
    for (w, m), v in t.items():
        if m != "store.put":  # handles and stats only
            assert v.bytes_sent < 2048 * v.calls and v.bytes_received < 2048 * v.calls, (w, m, v)
    # the plain-dict path ships the batch in every call
    RPC_TRAFFIC.reset()
    dist_ctrl.forward_batch(b)
    dist_ctrl.compute_advantages(dict(b))
    dist_ctrl.train_batch(b, None, None)
    plain = RPC_TRAFFIC.by_role()["dist"]
    assert plain.bytes_sent >= 3 * _nbytes(b) and plain.bytes_received >= _nbytes(b)


# ------------------------------------------------------------------ a PPO step
@pytest.fixture(scope="module")
def roles(sched):
    needs = ["prox_logp", "ref_logp", "values"]
    actor = start_train_controller(STUB, {"needs": needs}, sched, "actor", world_size=2)
    ref = start_train_controller(STUB, {}, sched, "ref", world_size=1)
    critic = start_train_controller(STUB, {"needs": ["returns"]}, sched, "critic", world_size=1)
    yield PPORoles(actor, ref=ref, critic=critic)
    for c in (actor, ref, critic):
        c.destroy()


def _config() -> PPOConfig:
    config = PPOConfig()
    config.actor.recompute_logprob = True  # the actor recomputes the proximal logprobs
    assert config.actor.should_compute_prox_logp()
    return config


def _timed(_name):
    return nullcontext()


def test_ppo_step_each_role_receives_batch_once_same_stats_as_shipped(roles):
    b = _batch([30, 12, 25, 7, 18, 31, 9, 22], T=64)
    RPC_TRAFFIC.reset()
    shipped = train_on_batch(roles, b, _config(), 0, _timed, held=False)
    before = RPC_TRAFFIC.by_role()
    RPC_TRAFFIC.reset()
    held = train_on_batch(roles, b, _config(), 0, _timed)
    after = RPC_TRAFFIC.by_role()
    assert held == pytest.approx(shipped) and held["consistency/fresh_tokens"] > 0
    size = _nbytes(b)
    t = RPC_TRAFFIC.snapshot()
    # actor: its shards once (store.put), then handles + the [B, T] tensors of ref/critic
    assert (
        sum(v.calls for (w, m), v in t.items() if m == "store.put" and w.startswith("actor")) == 2
    )
    batch_calls = [
        (w, m) for (w, m), v in t.items() if v.bytes_sent / v.calls >= size / 4 and m != "store.put"
    ]
    assert all(not w.startswith("actor") for w, _ in batch_calls), batch_calls
    assert after["actor"].bytes_sent < 2 * size < before["actor"].bytes_sent / 1.5
    assert after["actor"].bytes_received < size / 4 < before["actor"].bytes_received
    for role in ("ref", "critic"):
        assert after[role].bytes_sent < 1.5 * size, (role, after[role])
    for c in (roles.actor, roles.ref, roles.critic):
        assert all(h["n_batches"] == 0 for h in c.stored_batches()), c.role


def test_ppo_step_failure_still_frees_held_batches(roles, sched):
    b = _batch([5, 6, 7, 8])
    roles.actor.custom_function_call("configure", {"fail_update": True})
    try:
        with pytest.raises(RemoteCallError, match="update failed on purpose"):
            train_on_batch(roles, b, _config(), 0, _timed)
    finally:
        roles.actor.custom_function_call(
            "configure", {"needs": ["prox_logp", "ref_logp", "values"]}
        )
    for c in (roles.actor, roles.critic):
        assert all(h["n_batches"] == 0 for h in c.stored_batches()), c.role


def test_ppo_step_teacher_receives_batch_once_actor_gets_its_logp(roles):
    b = _batch([9, 14, 6, 11])
    teacher_roles = PPORoles(roles.actor, teacher=roles.ref)  # the stub scores like a teacher
    config = _config()
    config.teacher = TeacherConfig(rl_loss_weight=1.0, distill_loss_weight=0.5)
    roles.actor.custom_function_call(
        "configure", {"needs": ["prox_logp", "teacher_logp", "distill_loss_weight"]}
    )
    try:
        shipped = train_on_batch(teacher_roles, b, config, 0, _timed, held=False)
        RPC_TRAFFIC.reset()
        held = train_on_batch(teacher_roles, b, config, 0, _timed)
    finally:
        roles.actor.custom_function_call(
            "configure", {"needs": ["prox_logp", "ref_logp", "values"]}
        )
    assert held == pytest.approx(shipped)
    calls = {m: t.calls for (w, m), t in RPC_TRAFFIC.snapshot().items() if w == "ref/0"}
    assert calls == {"compute_logp": 1}  # the teacher's workers: the batch, once
    assert all(h["n_batches"] == 0 for h in roles.actor.stored_batches())


def test_ppo_step_wrapped_compute_advantages_on_a_plain_copy_reaches_the_update(roles):
    """User code that wraps ``actor.compute_advantages`` and hands it a modified plain
    dict (``{**batch, "rewards": ...}``) trains on what the wrapper computed, not on the
    held batch's rewards."""
    b = _batch([9, 14, 6, 11])
    flipped = {**b, "rewards": -b["rewards"]}
    plain = train_on_batch(roles, b, _config(), 0, _timed, held=False)
    expected = train_on_batch(roles, flipped, _config(), 0, _timed, held=False)
    assert plain != pytest.approx(expected)
    original = roles.actor.compute_advantages
    roles.actor.compute_advantages = lambda batch, *a, **k: original(
        {**batch, "rewards": -batch["rewards"]}, *a, **k
    )
    try:
        got = train_on_batch(roles, b, _config(), 0, _timed)
    finally:
        del roles.actor.compute_advantages
    assert got == pytest.approx(expected)
    for c in (roles.actor, roles.ref, roles.critic):
        assert all(h["n_batches"] == 0 for h in c.stored_batches()), c.role


def test_ppo_step_wrapper_replacing_rewards_on_the_held_batch_moves_only_the_rewards(roles):
    """A wrapper that reads and replaces ``rewards`` on the ``BatchRef`` (the VLM example's
    and the claims' reward controls) trains on the new rewards, and moves less than one
    that copies the batch into a plain dict (which fetches every key and sends it back)."""
    b = _batch([9, 14, 6, 11])
    expected = train_on_batch(
        roles, {**b, "rewards": -b["rewards"]}, _config(), 0, _timed, held=False
    )
    original = roles.actor.compute_advantages

    def on_the_ref(batch, *a, **k):
        batch["rewards"] = -batch["rewards"]
        return original(batch, *a, **k)

    def on_a_copy(batch, *a, **k):
        return original({**batch, "rewards": -batch["rewards"]}, *a, **k)

    moved = {}
    for name, wrapper in (("ref", on_the_ref), ("copy", on_a_copy)):
        roles.actor.compute_advantages = wrapper
        RPC_TRAFFIC.reset()
        try:
            got = train_on_batch(roles, b, _config(), 0, _timed)
        finally:
            del roles.actor.compute_advantages
        assert got == pytest.approx(expected), name
        moved[name] = sum(t.bytes_sent + t.bytes_received for t in RPC_TRAFFIC.snapshot().values())
    assert moved["ref"] < moved["copy"]
