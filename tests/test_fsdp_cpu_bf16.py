"""FSDPEngine with ``cpu_compute_dtype=bfloat16``: bf16 forward/backward under FSDP2 mixed
precision on CPU, float32 master weights, optimizer states and log-probabilities."""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import run_ranks
from test_fsdp_engine import loss_fn, loss_weight_fn, make_batch, make_config

pytestmark = pytest.mark.slow  # one engine session per dtype (~20 s)


def _session(rank, world_size, path):
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    res, batch = {}, make_batch()
    for name in ("float32", "bfloat16"):
        cfg = make_config(path)
        cfg.cpu_compute_dtype = name
        eng = FSDPEngine(cfg)
        eng.create_process_group()
        eng.initialize(None, FinetuneSpec(1, 10, 1))
        res[f"{name}_compute"] = eng.dtype
        res[f"{name}_master"] = {p.dtype for p in eng.model.parameters()}
        res[f"{name}_fwd"] = eng.forward_batch(batch)
        res[f"{name}_losses"] = [
            float(eng.train_batch(batch, loss_fn, loss_weight_fn)["loss"]) for _ in range(4)
        ]
        res[f"{name}_state"] = {
            t.dtype for s in eng.optimizer.state.values() for t in s.values() if t.dim()
        }
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import build_tiny_qwen2

    path = build_tiny_qwen2(str(tmp_path_factory.mktemp("bf16") / "m"))
    return run_ranks(_session, 1, (path,), timeout=300)[0]


def test_bf16_compute_keeps_float32_master_weights_and_optimizer_states(runs):
    assert runs["bfloat16_compute"] is torch.bfloat16
    assert runs["float32_compute"] is torch.float32
    assert runs["bfloat16_master"] == {torch.float32} == runs["float32_master"]
    assert runs["bfloat16_state"] == {torch.float32}


def test_bf16_logprobs_are_float32_and_close_to_the_float32_engine(runs):
    mask = make_batch()["attention_mask"].bool()
    lp16, lp32 = runs["bfloat16_fwd"], runs["float32_fwd"]
    assert lp16.dtype == torch.float32
    diff = (lp16 - lp32)[mask].abs()
    # really computed in bf16 (not silently float32), yet within bf16's rounding
    assert 0 < diff.max() < 0.25 and diff.mean() < 0.05


def test_bf16_training_lowers_the_loss_as_float32_does(runs):
    l16, l32 = runs["bfloat16_losses"], runs["float32_losses"]
    assert l16[-1] < l16[0] - 0.05
    assert abs(l16[0] - l32[0]) < 0.02 and abs(l16[-1] - l32[-1]) < 0.1
