"""Online mode: external OpenAI clients in other processes drive training.

A real PPOTrainer with ``rollout.agent.mode=online`` and no dataset; two client
processes (the official ``openai`` SDK plus plain HTTP for the session API) start
sessions with the admin key, chat, set rewards and end sessions while the trainer
takes steps. The staleness bound is checked on the trained batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


ADMIN = "online-test-admin"

CLIENT = textwrap.dedent(
    """
    import os, sys, time
    import httpx2 as httpx
    from openai import OpenAI

    base, admin, name, stop_file, out_file = sys.argv[1:6]
    done = 0
    question = "Tom has 3 pens. He buys 4 more. How many?"
    while not os.path.exists(stop_file):
        try:
            r = httpx.post(f"{base}/rl/start_session", json={"task_id": name},
                           headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if r.status_code == 429:  # no capacity now: the trainer is ahead of its budget
            time.sleep(0.05)
            continue
        r.raise_for_status()
        key = r.json()["api_key"]
        client = OpenAI(base_url=base, api_key=key, timeout=300)
        try:
            out = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": question}],
                max_tokens=8)
            text = out.choices[0].message.content or ""
            reward = 1.0 if "7" in text else float(len(text) % 2)
            hdr = {"Authorization": f"Bearer {key}"}
            httpx.post(f"{base}/rl/set_reward", json={"reward": reward}, headers=hdr,
                       timeout=30).raise_for_status()
            httpx.post(f"{base}/rl/end_session", json={}, headers=hdr,
                       timeout=30).raise_for_status()
        except Exception as e:  # the trainer may shut down mid-session at the end
            print(f"{name}: session failed: {e!r}", file=sys.stderr)
            continue
        done += 1
        with open(out_file, "w") as f:
            f.write(str(done))
        time.sleep(0.3)  # let the other client in
    """
)


def test_online_two_external_clients_feed_training_staleness_bounded(tiny_lm_dir, tmp_path):
    from test_rl_trainer import _grpo_config, _rows

    from areal import PPOTrainer
    from areal.utils.network import find_free_ports

    eta = 1
    port = find_free_ports(1)[0]
    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path),
        "total_train_steps=2",
        "allocation_mode=local:d1+fsdp:d1",
        "train_dataset.batch_size=3",
        "gconfig.n_samples=1",
        f"rollout.max_head_offpolicyness={eta}",
        "rollout.agent.mode=online",
        f"rollout.agent.admin_api_key={ADMIN}",
        f"rollout.agent.proxy_port={port}",
    )
    base = f"http://127.0.0.1:{port}"
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    stop = tmp_path / "stop"
    counts = [tmp_path / f"count{i}" for i in range(2)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), base, ADMIN, f"client{i}", str(stop), str(counts[i])],
            env=env,
        )
        for i in range(2)
    ]
    try:
        with PPOTrainer(cfg, train_dataset=None) as trainer:
            result = trainer.train()  # no workflow: external clients drive the episodes
            assert trainer.proxy_addr == base
            assert trainer.rollout.get_version() == 2
    finally:
        stop.write_text("stop")
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert result["steps_done"] == 2
    rows = _rows(result["log_dir"])
    assert [r["batch/n_seqs"] for r in rows] == [3, 3]
    for r in rows:
        assert r["staleness/max"] <= eta, r
        assert r["update_successful"] == 1.0
    done = [int(c.read_text()) if c.exists() else 0 for c in counts]
    assert sum(done) >= 6, done  # every trained row is one external session
    assert all(d >= 1 for d in done), done
