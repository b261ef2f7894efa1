"""The ``areal`` command line (areal/cli/): AReaL 2.0's verbs over our trainer and servers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from areal.cli.main import main
from areal.cli.train import default_driver

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "areal" / "models" / "assets" / "tiny-base"
AREAL = [sys.executable, "-m", "areal.cli"]


def _err(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_verbs_flags_and_configs_exit_2_with_a_message(capsys, tmp_path):
    assert "invalid choice: 'bogus'" in _err(capsys, ["bogus"])
    assert "unrecognized arguments: --nope" in _err(
        capsys, ["train", "--config", "x.yaml", "--nope"]
    )
    assert "required: --config" in _err(capsys, ["train"])
    assert "no such file" in _err(capsys, ["train", "run", "--config", str(tmp_path / "no.yaml")])
    cfg = REPO / "examples/math/gsm8k_grpo_cpu.yaml"
    assert "key=value" in _err(capsys, ["train", "--config", str(cfg), "total_train_steps"])
    assert "no function 'nope'" in _err(
        capsys, ["train", "--config", str(cfg), "--driver", "areal.cli.main:nope"]
    )
    assert "not an inference backend" in _err(
        capsys, ["inf", "--model-path", str(TINY), "--backend", "fsdp:d1"]
    )
    assert "--server-addrs" in _err(capsys, ["agent", "run"])
    assert "--agent is required" in _err(capsys, ["agent", "run", "--service", "default"])
    assert "cannot import 'areal.no_such'" in _err(
        capsys, ["agent", "run", "--agent", "areal.no_such.Agent"]
    )
    assert "has no attribute 'Nope'" in _err(
        capsys, ["agent", "run", "--model-path", str(TINY), "--agent", "areal.cli.main:Nope"]
    )


def test_default_driver_is_the_script_beside_the_yaml(tmp_path):
    assert default_driver(REPO / "examples/math/gsm8k_grpo_cpu.yaml").endswith("gsm8k_rl.py")
    assert default_driver(REPO / "examples/math/gsm8k_sft_cpu.yaml").endswith("gsm8k_sft.py")
    (tmp_path / "a.yaml").write_text("actor: {}\nrollout: {}\n")
    (tmp_path / "x_rl.py").write_text("")
    (tmp_path / "y_rl.py").write_text("")
    from areal.cli.train import CliError

    with pytest.raises(CliError, match="several"):
        default_driver(tmp_path / "a.yaml")


def test_driver_module_func_gets_config_and_overrides(tmp_path, monkeypatch):
    mod = tmp_path / "my_driver.py"
    mod.write_text("SEEN = []\ndef main(argv):\n    SEEN.append(argv)\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 1\n")
    assert main(["train", "run", "--config", str(cfg), "--driver", "my_driver:main", "a.b=1"]) == 3
    import my_driver

    assert my_driver.SEEN == [["--config", str(cfg.resolve()), "a.b=1"]]


def test_console_script_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert 'areal = "areal.cli.main:cli"' in text
    exe = shutil.which("areal", path=str(Path(sys.executable).parent))
    if exe:  # installed by make setup
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "train" in out.stdout and "agent" in out.stdout


def _read_until(proc: subprocess.Popen, prefix: str, deadline: float) -> str:
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"no {prefix!r} line; stdout: {lines}; stderr: {proc.stderr.read()}")


@pytest.mark.slow
def test_inf_serves_generate_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [*AREAL, "inf", "run", "--model-path", str(TINY), "--backend", "local:d1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        line = _read_until(proc, "AREAL_LLM_SERVER_ADDRS=", time.monotonic() + 400)
        addr = line.split("=", 1)[1]
        r = requests.post(
            f"http://{addr}/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "greedy": True}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://{addr}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_agent_run_serves_the_agent_service_and_stops_on_sigterm(tmp_path):
    # AReaL 2.0's flags; no --server-addrs / --model-path: the agent service
    key = "cli-agent-key"
    proc = subprocess.Popen(
        [*AREAL, "agent", "run", "--service", "clitest", "--num-pairs", "2",
         "--agent", "examples.agent_service.chat_agent.SessionChatAgent",
         "--admin-api-key", key],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )  # fmt: skip
    try:
        gateway = _read_until(proc, "gateway ", time.monotonic() + 120).split()[1]
        assert requests.get(f"{gateway}/health", timeout=10).json()["workers"] == 2
        r = requests.post(
            f"{gateway}/v1/responses",
            json={"input": [{"type": "message", "content": "hi"}], "model": "m", "user": "u"},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["status"] == "completed", r.text
        assert r.json()["output"][0]["content"][0]["text"] == "turn 1: hi"
        logs = tmp_path / "areal" / "logs" / "agent-clitest" / "run0"
        assert (logs / "agent-worker-1-0.log").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{gateway}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_train_runs_the_demo_config_and_writes_its_stats(tmp_path):
    cfg = REPO / "examples/math/gsm8k_grpo_cpu.yaml"
    out = subprocess.run(
        [
            *AREAL,
            "train",
            "--config",
            str(cfg),
            "total_train_steps=2",
            f"cluster.fileroot={tmp_path}",
            "evaluator.eval_before_train=false",
            "evaluator.freq_steps=null",
            "train_dataset.batch_size=4",
            "gconfig.n_samples=2",
            "valid_dataset.batch_size=8",
            "valid_dataset.path=synthetic://arith?digits=1&steps=2&n=16&seed=12345",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "held-out accuracy after  RL" in out.stdout  # gsm8k_rl.py's own summary
    stats = list(tmp_path.rglob("stats.jsonl"))
    assert stats, out.stdout[-2000:]
    rows = [json.loads(x) for x in stats[0].read_text().splitlines() if x.strip()]
    assert [r["global_step"] for r in rows] == [0, 1], rows
    assert all(any("reward" in k for k in r) for r in rows), sorted(rows[0])
