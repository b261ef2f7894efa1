"""AReaL's own ``examples/openclaw``, unchanged: ``train.py`` + ``config.yaml`` for 3 steps,
driven by its own ``demo_lifecycle.py``.

Opt-in: set ``AREAL_CHECKOUT`` (or ``AREAL_REFERENCE_DIR``) to an AReaL checkout, a work
tree or a bare git directory whose ``HEAD`` is read. The files are copied out of it into
a temporary directory (never into this repository). The trainer runs with command-line
overrides only (backends, CPU, the shipped tiny model, sizes, the proxy port); once its
proxy has granted a session, AReaL's ``start_session.py`` / ``set_reward.py`` play one
episode and refresh it (step 0), then ``demo_lifecycle.py`` plays 3 episodes with a new
key, whose 2 refreshes end 2 more sessions (steps 1 and 2): one session a step
(``train_dataset.batch_size=1``, the YAML's ``gconfig.n_samples: 1``).
``docs/areal_compat.md`` gives the commands.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from _areal_checkout import copy_areal_files, wait_for_grant

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TINY_BASE = os.path.join(REPO, "areal", "models", "assets", "tiny-base")
FILES = (
    "examples/openclaw/train.py",
    "examples/openclaw/config.yaml",
    "examples/openclaw/demo_lifecycle.py",
    "examples/openclaw/start_session.py",
    "examples/openclaw/set_reward.py",
    "examples/openclaw/_fmt.py",
)
ADMIN = "sk-test123456"  # the YAML's rollout.agent.admin_api_key

pytestmark = [pytest.mark.slow, pytest.mark.areal_checkout, pytest.mark.timeout(900)]


def _checkout_files(dest: str) -> dict[str, str]:
    files = copy_areal_files(dest, FILES, ("AREAL_CHECKOUT", "AREAL_REFERENCE_DIR"))
    return {os.path.basename(rel): target for rel, target in files.items()}


def _machine(stderr: str) -> dict[str, str]:
    """start_session.py's machine-readable ``NAME=value`` lines (on stderr)."""
    return dict(line.split("=", 1) for line in stderr.splitlines() if line.startswith("SESSION_"))


def _chat(base: str, key: str) -> None:
    import httpx2 as httpx

    body = {"model": "default", "messages": [{"role": "user", "content": "1 + 1 ="}]}
    r = httpx.post(
        f"{base}/chat/completions",
        json={**body, "max_tokens": 16},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_areal_openclaw_example_three_steps_driven_by_its_demo_lifecycle(tmp_path):
    from areal.utils.network import find_free_ports

    files = _checkout_files(str(tmp_path / "areal_ref"))
    fileroot = str(tmp_path / "fileroot")
    port = find_free_ports(1)[0]
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    overrides = [
        "rollout.backend=local:d1",
        "actor.backend=fsdp:d1",
        "cluster.n_gpus_per_node=0",
        f"actor.path={TINY_BASE}",
        f"cluster.fileroot={fileroot}",
        "total_train_steps=3",
        "train_dataset.batch_size=1",
        f"rollout.agent.proxy_port={port}",
    ]

    def run(name: str, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, files[name], *args],
            cwd=str(tmp_path),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        return proc

    log = open(tmp_path / "train.log", "w")
    cmd = [sys.executable, files["train.py"], "--config", files["config.yaml"], *overrides]
    trainer = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=log, stderr=log)
    try:
        wait_for_grant(base, trainer)
        # AReaL's single-step scripts: start, (a model call), reward, refresh = step 0.
        key = _machine(run("start_session.py", base, "--admin-key", ADMIN).stderr)
        _chat(base, key["SESSION_API_KEY"])
        run("set_reward.py", base, "--api-key", key["SESSION_API_KEY"], "--reward", "1.0")
        again = run(
            "start_session.py", base, "--admin-key", ADMIN, "--api-key", key["SESSION_API_KEY"]
        )
        assert _machine(again.stderr)["SESSION_API_KEY"] == key["SESSION_API_KEY"]
        # AReaL's demo: a new key, 3 episodes, 2 refreshes = steps 1 and 2.
        demo = subprocess.run(
            [
                sys.executable,
                files["demo_lifecycle.py"],
                base,
                "--admin-key",
                ADMIN,
                "--episodes",
                "3",
            ],
            cwd=str(tmp_path),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-2000:]
        assert demo.stdout.count("Session refreshed for Episode") == 2
        rc = trainer.wait(timeout=300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        log.close()
    text = (tmp_path / "train.log").read_text()
    assert rc == 0, text[-6000:]
    log_dir = os.path.join(fileroot, "logs", "online-rl", "trial0")
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["batch/n_seqs"] == 1  # one refreshed session per step
        assert r["batch/reward"] == 1.0  # demo_lifecycle's --reward default
        assert math.isfinite(r["ppo_actor/update/loss"])
    print(json.dumps({"step_seconds": [r.get("time/elapsed") for r in rows]}))
