"""Asynchronous DCP checkpoints (``tests/_async_ckpt_run.py``, one real FSDP rank): the
same files and values as a synchronous save, and a process killed (SIGKILL) during a
background recover-checkpoint write resumes from the previous checkpoint.

Both tests share one run (a training process, killed, then a resuming one: ~20 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from areal.utils.recover import list_complete_checkpoints, verify_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_async_ckpt_run.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    from conftest import build_tiny_qwen2

    base = tmp_path_factory.mktemp("async_ckpt")
    model = build_tiny_qwen2(str(base / "model"))
    root, out = base / "root", base / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE)
    args = [model, str(root), str(out)]
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "train", *args], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = ""
        while not line.startswith("PENDING"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the training process ended early"
        # killed while step 1's checkpoint is still being written in the background
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tmp = line.split(maxsplit=1)[1].strip()
    complete = list_complete_checkpoints(str(root / "checkpoints" / "e" / "t" / "recover"))
    left_tmp = os.path.isdir(tmp)
    r = subprocess.run(
        [sys.executable, SCRIPT, "resume", *args], env=env, capture_output=True, timeout=120
    )
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return {
        "equiv": torch.load(out / "equiv.pt"),
        "complete": complete,
        "left_tmp": left_tmp,
        "resumed": torch.load(out / "resumed.pt"),
        "p0": torch.load(out / "p0.pt"),
    }


def test_async_dcp_save_same_files_and_values_as_sync(killed_run):
    res = killed_run["equiv"]
    assert res["sync"] is False and res["async"] is True and res["pending"]
    assert res["moved"], "the step after the async save did not change the parameters"
    assert res["waited"].endswith("async")
    assert res["files"]["s"] == res["files"]["a"]
    assert res["auto_tiny"] is False  # 'auto' stays synchronous for a tiny state
    assert res["same_sync"] and res["same_async"]
    for k, v in res["next_sync"].items():
        assert torch.equal(v, res["next_async"][k]), k


def test_sigkill_during_background_write_resumes_from_previous_checkpoint(killed_run):
    assert killed_run["left_tmp"]  # the killed write never became a checkpoint
    complete = killed_run["complete"]
    assert [os.path.basename(d) for d in complete] == ["step00000000"]
    assert verify_checkpoint(complete[0]) is None
    resumed = killed_run["resumed"]
    assert resumed["step"] == 0
    for k, v in killed_run["p0"].items():
        assert torch.equal(resumed["params"][k], v), k
