"""The teacher on an inference engine: the built-in server's ``/score`` and ``ServerTeacher``
(``teacher.engine_type: rollout``) against the training engine's log-probabilities."""

from __future__ import annotations

import pytest
import requests
import torch
from _dist_helpers import run_ranks

from areal.api.cli_args import TeacherConfig
from areal.inference.server.launch import launch_local_server
from areal.inference.teacher import ServerTeacher, uses_server_teacher


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lens = [7, 12, 3, 9]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(3, 390, (n,), generator=g)
        mask[b, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _engine_logp(rank, world_size, path, temperature):
    from test_fsdp_engine import make_engine

    eng = make_engine(path)
    eng.temperature = temperature
    try:
        return eng.forward_batch(_batch())
    finally:
        eng.destroy()


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    group = launch_local_server(
        tiny_model_dir, num_servers=1, server_args={"dtype": "float32"}, timeout=600
    )
    yield group
    group.shutdown()


@pytest.mark.slow
def test_server_teacher_logp_equals_the_training_engines(servers, tiny_model_dir):
    batch = _batch()
    # the one server twice: the rows are split over two "servers" and put back in order
    teacher = ServerTeacher(servers.addresses * 2, temperature=0.7)
    got = teacher.compute_logp(batch)
    want = run_ranks(_engine_logp, 1, (tiny_model_dir, 0.7), timeout=400)[0]
    assert got.shape == want.shape == batch["input_ids"].shape
    assert (got[batch["attention_mask"] == 0] == 0).all() and (got[:, 0] == 0).all()
    assert got[:, 1:].abs().sum() > 0
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # one row alone gives the same values as inside the batch (padding is masked)
    one = requests.post(
        f"http://{servers.addresses[0]}/score",
        json={"input_ids": batch["input_ids"][1].tolist(), "temperature": 0.7},
        timeout=60,
    ).json()["logprobs"][0]
    torch.testing.assert_close(torch.tensor(one), got[1], atol=2e-5, rtol=1e-5)
    # bad bodies are 400s that name the field
    r = requests.post(f"http://{servers.addresses[0]}/score", json={"input_ids": []}, timeout=60)
    assert r.status_code == 400 and "input_ids" in r.text
    r = requests.post(
        f"http://{servers.addresses[0]}/score",
        json={"input_ids": [1, 2], "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 400 and "temperature" in r.text


def test_uses_server_teacher_only_for_a_local_rollout_backend():
    assert uses_server_teacher(TeacherConfig(path="x", rollout={"backend": "local:d2"}))
    assert not uses_server_teacher(TeacherConfig(path="x", rollout={"backend": "vllm:d1"}))
    assert not uses_server_teacher(TeacherConfig(path="x"))  # 1.x: own fields, train engine
    assert not uses_server_teacher(None)
