"""AReaL's own ``examples/math/gsm8k_rl.py`` + ``gsm8k_grpo.yaml``, unchanged, 3 steps on CPU.

Opt-in: set ``AREAL_REFERENCE_DIR`` to an AReaL checkout (a work tree, or a bare git
directory whose ``HEAD`` is read). The two files are copied out of it into a temporary
directory (never into this repository) and run with command-line overrides only:

- ``paths``: model path -> the shipped tiny model, data -> synthetic GSM8K-format problems;
- ``hub``: no path override at all: ``Qwen/Qwen2.5-1.5B-Instruct`` and ``openai/gsm8k``
  resolve through a Hugging Face cache built in the test (the tiny model and synthetic
  problems stored under those ids), with ``HF_HUB_OFFLINE=1``.

Both also override backends (``local:d1`` + ``fsdp:d1``), ``cluster.n_gpus_per_node=0``,
the file root and sizes. ``docs/areal_compat.md`` gives the command.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from _areal_checkout import copy_areal_files

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TINY_BASE = os.path.join(REPO, "areal", "models", "assets", "tiny-base")
FILES = ("examples/math/gsm8k_rl.py", "examples/math/gsm8k_grpo.yaml")
MODEL_ID, DATASET_ID = "Qwen/Qwen2.5-1.5B-Instruct", "openai/gsm8k"
BS, N = 8, 4  # train_dataset.batch_size override; gconfig.n_samples of the YAML

pytestmark = [pytest.mark.slow, pytest.mark.areal_checkout, pytest.mark.timeout(900)]


def _reference_files(dest: str) -> dict[str, str]:
    return copy_areal_files(dest, FILES, ("AREAL_REFERENCE_DIR",))


def _fake_hub(home: str) -> None:
    """An HF cache holding the tiny model as MODEL_ID and synthetic problems as DATASET_ID."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from areal.dataset.synthetic import generate_arith_problems, parse_synthetic_path

    rev = "0" * 40

    def snapshot(kind: str, repo_id: str) -> str:
        folder = os.path.join(home, "hub", f"{kind}s--" + repo_id.replace("/", "--"))
        os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
        with open(os.path.join(folder, "refs", "main"), "w") as f:
            f.write(rev)
        return os.path.join(folder, "snapshots", rev)

    shutil.copytree(TINY_BASE, snapshot("model", MODEL_ID))
    data = os.path.join(snapshot("dataset", DATASET_ID), "main")
    os.makedirs(data)
    spec = parse_synthetic_path("synthetic://arith?digits=1&steps=2&n=256&seed=0")
    for split in ("train", "test"):
        rows = generate_arith_problems(spec, split=split)[: 256 if split == "train" else 16]
        table = pa.Table.from_pylist(
            [{"question": r["question"], "answer": r["answer"]} for r in rows]
        )
        pq.write_table(table, os.path.join(data, f"{split}-00000-of-00001.parquet"))


@pytest.mark.parametrize("mode", ["paths", "hub"])
def test_areal_gsm8k_rl_script_runs_three_steps_unchanged(mode, tmp_path):
    files = _reference_files(str(tmp_path / "areal_ref"))
    fileroot = str(tmp_path / "fileroot")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    overrides = [
        "rollout.backend=local:d1",
        "actor.backend=fsdp:d1",
        "cluster.n_gpus_per_node=0",
        f"cluster.fileroot={fileroot}",
        "total_train_steps=3",
        f"train_dataset.batch_size={BS}",
        "valid_dataset.batch_size=16",
        "train_dataset.num_workers=0",
        "valid_dataset.num_workers=0",
        "gconfig.max_new_tokens=32",
    ]
    if mode == "paths":
        overrides += [
            f"actor.path={TINY_BASE}",
            "train_dataset.path=synthetic://arith?digits=1&steps=2&n=2000&seed=0",
            "valid_dataset.path=synthetic://arith?digits=1&steps=2&n=16&seed=1",
        ]
    else:
        home = str(tmp_path / "hf_home")
        _fake_hub(home)
        env.update(HF_HOME=home, HF_HUB_OFFLINE="1")
        env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, files[FILES[0]], "--config", files[FILES[1]], *overrides]
    proc = subprocess.run(
        cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=850
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    log_dir = os.path.join(fileroot, "logs", "gsm8k-grpo", "trial0")
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if r["global_step"] >= 0]
    assert [r["global_step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["batch/n_seqs"] == BS * N  # whole groups of the YAML's n_samples
        assert math.isfinite(r["ppo_actor/update/loss"])
        assert 0.0 <= r["batch/reward"] <= 1.0
    assert any("eval/accuracy" in r for r in rows)
    summary = {
        "mode": mode,
        "reward": [r["batch/reward"] for r in steps],
        "loss": [r["ppo_actor/update/loss"] for r in steps],
        "step_seconds": [r.get("time/elapsed") for r in steps],
    }
    print(json.dumps(summary))
