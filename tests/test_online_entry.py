"""AReaL's online entry: ``PPOTrainer(config)`` + ``train()``, session refresh, openclaw scripts.

- the proxy's session refresh (a start with a live session's key ends that session,
  reward 0 when none was set, and binds the key to a new one), with and without online
  capacity control, against a real built-in server;
- the client scripts of ``examples/openclaw`` (AReaL's command line, our code) run as
  subprocesses against the proxy;
- a real online run: ``PPOTrainer(config)`` without a dataset, ``train()`` without a
  workflow, driven by a client that refreshes its session with one key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.timeout(300)]

import httpx2 as httpx  # noqa: E402

from areal.experimental.openai import ArealOpenAI  # noqa: E402
from areal.experimental.openai.proxy import ProxyServer, deserialize_interactions  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPTS = os.path.join(REPO, "examples", "openclaw")
TINY_BASE = os.path.join(REPO, "areal", "models", "assets", "tiny-base")
ADMIN = "online-entry-admin"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "2 + 3 ="}], "max_tokens": 6}


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    """A real online run, ``PPOTrainer(config)`` + ``train()``, driven by a refreshing client.

    The trainer stays open for the module: the proxy tests below generate with its
    inference server (``trainer.rollout``) instead of starting another one."""
    from test_rl_trainer import _grpo_config

    from areal import PPOTrainer
    from areal.utils.network import find_free_ports

    port = find_free_ports(1)[0]
    cfg = _grpo_config(
        TINY_BASE,
        str(tmp_path_factory.mktemp("online_run")),
        "total_train_steps=2",
        "allocation_mode=local:d1+fsdp:d1",
        "train_dataset.batch_size=1",
        "gconfig.n_samples=1",
        "rollout.max_head_offpolicyness=1",
        "rollout.agent.mode=online",
        f"rollout.agent.admin_api_key={ADMIN}",
        f"rollout.agent.proxy_port={port}",
    )
    base = f"http://127.0.0.1:{port}"
    seen: dict = {"keys": [], "sessions": [], "errors": []}

    def lifecycle():
        deadline = time.monotonic() + 240
        while True:  # until the trainer's proxy is up and has granted a session
            try:
                r = _start(base)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the trainer's proxy never admitted a session"
            time.sleep(0.2)
        key = r.json()["api_key"]
        seen["sessions"].append(r.json()["session_id"])
        _chat(base, key)  # episode 1: no reward (0 on refresh)
        for reward in (1.0, None):
            r = _start(base, key, timeout=130)  # refresh: episode ends, key rebinds
            assert r.status_code == 200, r.text
            seen["keys"].append(r.json()["api_key"])
            seen["sessions"].append(r.json()["session_id"])
            if reward is not None:
                _chat(base, key)
                assert _post(base, "rl/set_reward", key, {"reward": reward}).status_code == 200
        seen["health"] = httpx.get(f"{base}/health", timeout=30).json()

    def run():
        try:
            lifecycle()
        except BaseException as e:  # reported by the test
            seen["errors"].append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    with PPOTrainer(cfg) as trainer:  # AReaL's online entry: no dataset ...
        result = trainer.train()  # ... and no workflow
        version = trainer.rollout.get_version()
        t.join(60)
        yield {"trainer": trainer, "result": result, "version": version, "seen": seen}


def _client(online_run):
    trainer = online_run["trainer"]
    return ArealOpenAI(
        trainer.rollout, trainer.tokenizer, chat_template_type="concat", engine_max_tokens=256
    )


def _post(base, path, key, body=None, timeout=60):
    return httpx.post(
        f"{base}/{path}",
        json=body or {},
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def _start(base, api_key=None, timeout=60):
    return _post(base, "rl/start_session", ADMIN, {"task_id": "t", "api_key": api_key}, timeout)


def _chat(base, key):
    r = _post(base, "chat/completions", key, CHAT)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _export(base, session_id):
    r = _post(base, "export_trajectories", ADMIN, {"session_id": session_id})
    assert r.status_code == 200, r.text
    return deserialize_interactions(r.json()["interactions"])


def test_ppo_trainer_config_only_online_entry_trains_on_refreshed_sessions(online_run):
    from test_rl_trainer import _rows

    seen, result = online_run["seen"], online_run["result"]
    assert not seen["errors"], seen["errors"]
    assert result["steps_done"] == 2 and online_run["version"] == 2
    rows = _rows(result["log_dir"])
    assert [r["batch/n_seqs"] for r in rows] == [1, 1]
    # Step 0 trained the session refreshed without a reward, step 1 the rewarded one.
    assert [r["batch/reward"] for r in rows] == [0.0, 1.0], rows
    assert seen["keys"] == [seen["keys"][0]] * 2 and len(set(seen["sessions"])) == 3
    assert seen["health"]["sessions_refreshed"] == 2
    with open(os.path.join(result["log_dir"], "consumed.jsonl")) as f:
        consumed = [json.loads(line) for line in f if line.strip()]
    assert len(consumed) == 2, consumed


def test_refresh_ends_old_session_reward_zero_and_rebinds_key(online_run):
    with ProxyServer(_client(online_run), admin_api_key=ADMIN) as srv:
        base = srv.base_url
        first = _start(base).json()
        key = first["api_key"]
        cid = _chat(base, key)  # no reward set
        r = _start(base, key)
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["api_key"] == key and second["session_id"] != first["session_id"]
        # The old session is ended and exportable; its unrewarded last call got 0.
        old = _export(base, first["session_id"])
        assert list(old) == [cid] and old[cid].reward == 0.0
        # The key now belongs to the new session: its calls and reward land there.
        cid2 = _chat(base, key)
        assert _post(base, "rl/set_reward", key, {"reward": 0.75}).status_code == 200
        third = _start(base, key).json()
        assert third["api_key"] == key
        new = _export(base, second["session_id"])
        assert list(new) == [cid2] and new[cid2].reward == 0.75  # a set reward is kept
        # A refresh of a session without calls ends it with nothing to train on.
        fourth = _start(base, key).json()
        assert _export(base, third["session_id"]) == {}
        assert srv.state.stats["sessions_refreshed"] == 3
        # The admin key is never a session key; an unknown key simply starts a session.
        assert _start(base, ADMIN).status_code == 400
        assert _start(base, "sk-never-issued").status_code == 200
        assert fourth["session_id"] in srv.state.sessions


def test_online_refresh_waits_for_a_grant_or_answers_429(online_run):
    client = _client(online_run)
    with ProxyServer(client, ADMIN, capacity_control=True, refresh_timeout=1.0) as srv:
        base = srv.base_url
        assert _start(base).status_code == 429  # no grant yet
        slot = _post(base, "grant_capacity", ADMIN).json()["slot_id"]
        assert httpx.get(f"{base}/health").json()["open_grants"] == 1
        first = _start(base).json()
        key = first["api_key"]
        _chat(base, key)
        # The trainer's task of the grant sees the session end through the refresh.
        waited = {}

        def wait():
            waited["r"] = _post(base, "internal/wait_for_session", ADMIN, {"slot_id": slot})

        t = threading.Thread(target=wait)
        t.start()
        t0 = time.monotonic()
        r = _start(base, key)  # no second grant: times out after refresh_timeout
        assert r.status_code == 429 and "refresh timed out" in r.text, r.text
        assert 0.9 <= time.monotonic() - t0 < 10
        t.join(30)
        assert waited["r"].json()["session_id"] == first["session_id"]
        assert next(iter(_export(base, first["session_id"]).values())).reward == 0.0
        # The key is free again; a start with it waits for the grant made meanwhile.
        srv.state.refresh_timeout = 30.0
        second = _start(base).json()  # no capacity now: 429 ...
        assert "error" in second
        _post(base, "grant_capacity", ADMIN)
        again = _start(base, key).json()  # ... an unbound key just starts (grant open)
        assert again["api_key"] == key
        _chat(base, key)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", _start(base, key)))
        t.start()
        time.sleep(0.5)
        assert "r" not in out  # waiting for the trainer to grant capacity
        _post(base, "grant_capacity", ADMIN)
        t.join(30)
        assert out["r"].status_code == 200 and out["r"].json()["api_key"] == key
        # A refresh of a key whose refresh is still under way is refused.
        srv.state.refreshing.add(key)
        assert _start(base, key).status_code == 429
        srv.state.refreshing.discard(key)


def _script(name, *args, env=None):
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _machine_lines(text):
    return dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and line[:1].isupper()
    )


def test_openclaw_client_scripts_command_line_against_proxy(online_run):
    with ProxyServer(_client(online_run), admin_api_key=ADMIN) as srv:
        base = srv.base_url
        out = _machine_lines(
            _script("start_session.py", base, "--admin-key", ADMIN, "--task-id", "cli").stderr
        )
        key, sid = out["SESSION_API_KEY"], out["SESSION_ID"]
        assert sid.startswith("cli-")
        _chat(base, key)
        cid = _chat(base, key)
        _script("set_reward.py", base, "--api-key", key, "--reward", "0.5")
        first = _chat(base, key)
        _script("set_reward.py", base, "--api-key", key, "--reward", "-1", "--interaction-id", cid)
        # Refresh through the environment variables the scripts read (AReaL's names).
        env = {"ADMIN_KEY": ADMIN, "SESSION_API_KEY": key}
        again = _machine_lines(_script("start_session.py", base, env=env).stderr)
        assert again["SESSION_API_KEY"] == key and again["SESSION_ID"] != sid
        rewards = {k: v.reward for k, v in _export(base, sid).items()}
        assert rewards[cid] == -1.0 and rewards[first] == 0.0  # last call: no reward, 0

        proc = _script(
            "demo_lifecycle.py", base, "--admin-key", ADMIN, "--episodes", "3", "--reward", "0.25"
        )
        sessions = [
            line.split()[3].rstrip(",")
            for line in proc.stdout.splitlines()
            if line.startswith("episode ") and ": session " in line
        ]
        assert len(sessions) == 3 and len(set(sessions)) == 3, proc.stdout
        for s in sessions[:2]:  # ended by the refreshes of the next episode
            (it,) = _export(base, s).values()
            assert it.reward == 0.25
        assert not srv.state.sessions[sessions[2]].ended  # the last one stays open
        assert srv.state.stats["sessions_refreshed"] == 3
        bad = subprocess.run(
            [sys.executable, os.path.join(SCRIPTS, "set_reward.py"), base, "--api-key", "nope"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 1 and "401" in bad.stdout


def test_online_rows_per_step_and_dataset_required_outside_online_mode():
    from test_rl_trainer import _grpo_config

    from areal.experimental.openai.proxy.trainer_wiring import online_dataset

    cfg = _grpo_config(TINY_BASE, "/tmp", "total_train_steps=5", "total_train_epochs=2")
    with pytest.raises(ValueError, match="needs a train_dataset unless"):
        online_dataset(cfg)  # mode 'inline': a dataset is required
    cfg = _grpo_config(
        TINY_BASE,
        "/tmp",
        "rollout.agent.mode=online",
        "total_train_steps=5",
        "total_train_epochs=2",
        "train_dataset.batch_size=3",
    )
    rows = online_dataset(cfg)  # 3 steps an epoch (5 / 2 rounded up), 3 rows a step
    assert rows == [{}] * 9
    cfg.total_train_steps = None
    with pytest.raises(ValueError, match="needs total_train_steps"):
        online_dataset(cfg)
