"""Delta weight transfer end to end on real components: a ``TrainController`` with one
``FSDPEngine`` worker (gloo, 1 rank, AdamW at a small lr), a real built-in server in
bfloat16 on 127.0.0.1, the ``WeightSynchronizer`` with the ``DeltaTransport`` and the
verified weight sync's ``WeightFingerprintHook`` (every tensor's row sums at every sync).

A full sync first, then deltas after real optimizer steps (the fingerprint check passes:
the server holds exactly the trainer's weights cast to bf16; far fewer bytes than full);
deltas with the wrong base version or dtype refused with HTTP 400; a refused delta rolled
back to the previous weights, then a full sync; the anchor interval forces a full sync.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
import requests
from _train_config import tiny_train_config
from _weight_sync_stack import tests_on_pythonpath as _on_pythonpath
from _weight_sync_stack import train_step

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal.infra.weights.weight_sync import WeightSyncHook, WeightSynchronizer
from areal.infra.weights.weight_verify import WeightFingerprintHook
from areal.utils.auth import auth_headers, get_run_secret

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@contextlib.contextmanager
def _stack(root: str, model_dir: str):
    from areal.inference.clients.local import RemoteLocalEngine
    from areal.infra.controller.train_controller import TrainController
    from areal.infra.scheduler.local import LocalScheduler

    # lr 1e-6: one AdamW step moves each weight by ~1e-6, so most bf16 values stay put
    config = tiny_train_config(
        model_dir, "wdelta", lr=1e-6, weight_decay=0.0, warmup_steps_proportion=0.0
    )
    with _on_pythonpath():
        sched = LocalScheduler(fileroot=root, startup_timeout=180, call_timeout=180)
        actor = TrainController("areal.engine.fsdp_engine.FSDPEngine", config, sched)
        engine = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=180, request_timeout=60))
        try:
            actor.initialize(
                "actor",
                world_size=1,
                ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1),
            )
            engine.launch_server({"model_path": model_dir, "dtype": "bfloat16"})
            engine.initialize(train_data_parallel_size=1)
            meta = WeightUpdateMeta.from_disk("wdelta", "t", root)
            meta.delta, meta.delta_dtype, meta.delta_anchor_interval = True, "bfloat16", 3
            actor.connect_engine(engine, meta)
            yield actor, engine, meta
        finally:
            engine.destroy()
            engine.teardown_server()
            actor.destroy()
            sched.close()


class _Refuse(WeightSyncHook):
    def __init__(self):
        self.on = False

    def verify(self, ctx):
        if self.on:
            raise RuntimeError("refused by the test")


def _H() -> dict:
    return auth_headers(get_run_secret())


def _fingerprint(addr: str) -> dict:
    r = requests.post(
        f"http://{addr}/weights_fingerprint", json={"seed": 7}, headers=_H(), timeout=30
    )
    r.raise_for_status()
    return r.json()


def _post_delta(addr: str, path: str, version: int) -> requests.Response:
    body = {"model_path": path, "version": version}
    url = f"http://{addr}/update_weights_from_delta"
    return requests.post(url, json=body, headers=_H(), timeout=30)


def test_weight_delta_bf16_server_full_then_deltas_verified_refusals_rollback_anchor(
    tmp_path, tiny_model_dir
):
    with _stack(str(tmp_path), tiny_model_dir) as (actor, engine, meta):
        addr = engine.addresses[0]
        assert _fingerprint(addr)["dtypes"]["model.embed_tokens.weight"] == "bfloat16"
        verify, refuse = WeightFingerprintHook(full_every=1), _Refuse()
        sync = WeightSynchronizer(
            actor, engine, meta, hooks=[verify, refuse], max_consecutive_refusals=None
        )
        train_step(actor)
        s1 = sync.sync(1)
        assert s1["weight_sync/delta"] == 0.0  # the first sync is full (the base)
        assert s1["weight_sync/fingerprint_servers"] == 1.0
        deltas = []
        for v in (2, 3):
            train_step(actor)
            s = sync.sync(v)
            assert s["weight_sync/delta"] == 1.0, s
            assert "weight_sync/refused" not in s
            # verified against the trainer's export cast to bf16, every tensor's row sums
            assert s["weight_sync/fingerprint_servers"] == 1.0
            for k in ("tensors", "full_tensors", "in_response_servers"):
                assert s[f"weight_sync/fingerprint_{k}"] == s1[f"weight_sync/fingerprint_{k}"]
            assert 0 < s["weight_sync/delta_changed_fraction"] < 0.2
            assert s["weight_sync/delta_bytes"] * 3 < s["weight_sync/delta_dense_bytes"]
            deltas.append(s)
        assert engine.get_version() == 3 and actor.get_version() == 3
        state = actor.weight_delta_state()
        assert (state["version"], state["deltas"], state["dtype"]) == (3, 2, "bfloat16")
        v3 = meta.with_version(3).path
        assert not any(f.endswith(".safetensors") for f in os.listdir(v3))  # not a full dir
        manifest = json.load(open(os.path.join(v3, "delta", "manifest.json")))
        assert (manifest["base_version"], manifest["version"]) == (2, 3)
        assert manifest["totals"]["bytes"] == deltas[-1]["weight_sync/delta_bytes"]

        # a delta against another base, or in another dtype: HTTP 400, nothing changes
        before = _fingerprint(addr)
        r = _post_delta(addr, v3, 3)
        assert r.status_code == 400 and "base version 2" in r.text and "version 3" in r.text
        bad = str(tmp_path / "bad")
        shutil.copytree(v3, bad)
        manifest.update(base_version=3, dtype="float32")
        json.dump(manifest, open(os.path.join(bad, "delta", "manifest.json"), "w"))
        r = _post_delta(addr, bad, 3)
        assert r.status_code == 400 and "float32" in r.text and "bfloat16" in r.text
        assert _fingerprint(addr)["fingerprints"] == before["fingerprints"]

        # a delta refused after it was applied: rolled back to version 3's weights
        train_step(actor)
        refuse.on = True
        s4 = sync.sync(4)
        refuse.on = False
        assert s4["weight_sync/refused"] == 1.0 and s4["weight_sync/delta"] == 1.0
        after = _fingerprint(addr)
        assert after["version"] == 3 and after["fingerprints"] == before["fingerprints"]
        assert actor.weight_delta_state()["full_next"] is True
        # ... then a full sync, deltas again, and a full one after 3 deltas (the anchor)
        kinds = [(sync.sync(v)["weight_sync/delta"], train_step(actor))[0] for v in range(4, 9)]
        assert kinds == [0.0, 1.0, 1.0, 1.0, 0.0]
        assert sync.last_stats["weight_sync/delta_anchor"] == 1.0
        assert sync.last_stats["weight_sync/fingerprint_servers"] == 1.0
        assert engine.get_version() == 8
        assert actor.weight_delta_state()["deltas"] == 0


def test_weight_delta_ppo_trainer_enable_delta_weight_update_verified_syncs(tiny_lm_dir, tmp_path):
    """``actor.enable_delta_weight_update=true`` in a real 3-step GRPO run (built-in server
    in bf16, verified weight sync on): the first sync is full, the others deltas, none
    refused; the servers end at the trainer's version."""
    from test_rl_trainer import _grpo_config, _rows, _workflow_kwargs

    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=3",
        "actor.enable_delta_weight_update=true",
        "actor.weight_update_anchor_interval=0",
        "actor.optimizer.lr=1e-6",
        "rollout.verify_weights=true",
    )
    assert cfg.actor.weight_update_mode == "disk"
    # a CPU config maps the training dtype to float32 at load; the built-in servers are
    # started with the actor's dtype: bf16 servers (the trainer computes in float32)
    cfg.actor.dtype = "bfloat16"
    tok = load_hf_tokenizer(cfg.tokenizer_path)
    train = get_custom_dataset("train", cfg.train_dataset, tok)
    with PPOTrainer(cfg, train_dataset=train) as trainer:
        assert trainer.weight_update_meta.delta
        assert trainer.weight_update_meta.delta_dtype == "bfloat16"
        result = trainer.train(
            workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=_workflow_kwargs(cfg)
        )
        assert trainer.rollout.get_version() == trainer.actor.get_version() == 3
        assert trainer.weight_sync.total_refusals == 0
        assert trainer.actor.weight_delta_state()["version"] == 3
        log_dir = result["log_dir"]
    rows = _rows(log_dir)
    assert [r["weight_sync/delta"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows[1:]:
        assert 0 < r["weight_sync/delta_bytes"] < r["weight_sync/delta_dense_bytes"]
    assert not any(r.get("weight_sync/refusals_total") for r in rows)
