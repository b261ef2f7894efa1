"""AReaL 2.0's own agent-service clients, unchanged, against our agent service.

Opt-in: set ``AREAL_REFERENCE_DIR`` (or ``AREAL_CHECKOUT``) to an AReaL checkout, a work
tree or a bare git directory whose ``HEAD`` is read; the files are copied out of it into
a temporary directory.

- ``examples/agent_service/run_agent_service.py``: its ``interactive_loop`` (imported
  from the checkout, stdin fed) against our ``AgentController`` as its ``main`` builds
  it, with our agent (its ``ClaudeAgent`` needs a paid API); then, with that agent in
  training mode (``AREAL_AGENT_INF_*`` in ``scheduling_spec[0].env_vars``, naming an
  online ``PPOTrainer``'s proxy), 3 training steps driven by three stdin lines, one
  episode a turn; and a bad training-mode configuration printed as the client's
  ``Error:`` line.
- ``examples/hermes``: its ``train.py`` + ``config.yaml`` (CPU / tiny-model overrides),
  ``areal agent run --agent examples.hermes.hermes.HermesAgent``, then per episode its
  ``start_session.py`` (start, later refresh), ``hermes_loop.py`` (stdin) and
  ``set_reward.py``: 3 training steps. Needs ``make hermes-agent`` (PyPI hermes-agent in
  ``.venv-hermes``, put on the workers' ``PYTHONPATH``; ``AREAL_HERMES_DIR`` overrides).
  The tiny model's 1024 positions are raised to 8192 in a copy (Hermes' system prompt
  alone is ~1.5k characters; the tokenizer is character-level), and Hermes runs without
  tools (``HERMES_ENABLED_TOOLSETS=none``, which its ``hermes.py`` reads): its tools'
  schemas are ~41k characters more. Hermes' ``config.yaml`` (in a temporary
  ``HERMES_HOME``) sets ``model.max_tokens: 16``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from _areal_checkout import copy_areal_files, wait_for_grant

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TINY_BASE = os.path.join(REPO, "areal", "models", "assets", "tiny-base")
ENV_VARS = ("AREAL_REFERENCE_DIR", "AREAL_CHECKOUT")
AGENT = "examples.agent_service.chat_agent.SessionChatAgent"

pytestmark = [pytest.mark.areal_checkout]

DRIVER = textwrap.dedent(
    """
    import asyncio, importlib.util, sys
    path, agent, key, fileroot = sys.argv[1:5]
    spec = importlib.util.spec_from_file_location("run_agent_service", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # 2.0's module: its imports resolve to this project
    from areal.infra.scheduler.local import LocalScheduler
    scheduler = LocalScheduler(experiment_name="agent-service-demo", trial_name="run0",
                               gpu_devices=[], fileroot=fileroot)
    ctrl = mod.AgentController(
        config=mod.AgentConfig(agent_cls_path=agent, admin_api_key=key), scheduler=scheduler)
    try:
        ctrl.initialize()
        print("pairs", len(ctrl.pairs), "router", ctrl.router_addr)
        asyncio.run(mod._wait_healthy(f"{ctrl.gateway_addr}/health"))
        asyncio.run(mod.interactive_loop(ctrl.gateway_addr, admin_key=key))
    finally:
        ctrl.destroy()
    """
)


def test_areal_run_agent_service_interactive_loop_against_our_controller(tmp_path):
    files = copy_areal_files(
        str(tmp_path / "ref"), ["examples/agent_service/run_agent_service.py"], ENV_VARS
    )
    (tmp_path / "driver.py").write_text(DRIVER)
    key = "areal-agent-admin"  # run_agent_service.py's default --admin-api-key
    proc = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "driver.py"),
            files["examples/agent_service/run_agent_service.py"],
            AGENT,
            key,
            str(tmp_path / "fileroot"),
        ],  # fmt: skip
        input="hello\n\nagain\ncrash\nthird\nquit\n",
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "pairs 1 router http://127.0.0.1:" in out
    assert "Agent: turn 1: hello" in out
    assert "Agent: turn 2: again" in out  # the history was replayed to the agent
    assert out.count("[tool] count_turns") == 3
    assert "Error: agent examples.agent_service.chat_agent.SessionChatAgent failed: " in out
    assert "Agent: turn 3: third" in out  # the failed turn left the history unchanged


TRAIN_DRIVER = textwrap.dedent(
    """
    import asyncio, importlib.util, json, sys, time
    import httpx
    path, agent, key, fileroot, env_json, inf = sys.argv[1:7]
    spec = importlib.util.spec_from_file_location("run_agent_service", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from areal.api.cli_args import SchedulingSpec
    from areal.infra.scheduler.local import LocalScheduler
    scheduler = LocalScheduler(experiment_name="agent-service-demo", trial_name="run0",
                               gpu_devices=[], fileroot=fileroot)
    # the operator's configuration: the agent's inference gateway, through the workers' env
    spec = SchedulingSpec(cpu=1, mem=1, env_vars=json.loads(env_json))
    config = mod.AgentConfig(agent_cls_path=agent, admin_api_key=key, scheduling_spec=[spec])
    ctrl = mod.AgentController(config=config, scheduler=scheduler)
    try:
        ctrl.initialize()
        asyncio.run(mod._wait_healthy(f"{ctrl.gateway_addr}/health"))
        deadline = time.monotonic() + 600  # until the trainer admits its first episode
        while inf and time.monotonic() < deadline:
            try:
                if httpx.get(f"{inf}/health", timeout=5).json().get("open_grants", 0) > 0:
                    break
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.5)
        asyncio.run(mod.interactive_loop(ctrl.gateway_addr, admin_key=key))
    finally:
        ctrl.destroy()
    """
)
QUESTIONS = ("What is 2 + 3?", "Tell me a joke.", "What is 7 * 6?")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_areal_interactive_loop_drives_three_online_training_steps(tiny_lm_dir, tmp_path):
    """2.0's ``interactive_loop`` only chats; our ``SessionChatAgent`` in training mode
    (its worker's env names the trainer's proxy and admin key) makes each turn an episode:
    start_session, the model call, set_reward (arithmetic_reward), end_session."""
    from test_rl_trainer import _grpo_config, _rows

    from areal import PPOTrainer
    from areal.utils.network import find_free_ports
    from examples.agent_service.chat_agent import arithmetic_reward

    files = copy_areal_files(
        str(tmp_path / "ref"), ["examples/agent_service/run_agent_service.py"], ENV_VARS
    )
    (tmp_path / "driver.py").write_text(TRAIN_DRIVER)
    port = find_free_ports(1)[0]
    inf, inf_admin = f"http://127.0.0.1:{port}", "online-agent-admin"
    cfg = _grpo_config(
        tiny_lm_dir,
        str(tmp_path / "train"),
        "total_train_steps=3",
        "allocation_mode=local:d1+fsdp:d1",
        "train_dataset.batch_size=1",
        "gconfig.n_samples=1",
        "rollout.agent.mode=online",
        f"rollout.agent.admin_api_key={inf_admin}",
        f"rollout.agent.proxy_port={port}",
        "rollout.dump_to_file=true",
        f"rollout.tokenizer_path={tiny_lm_dir}",
    )
    agent_env = {
        "AREAL_AGENT_INF_BASE_URL": inf,
        "AREAL_AGENT_INF_ADMIN_KEY": inf_admin,
        "AREAL_AGENT_DEFAULT_REWARD": "0.5",
    }
    out_path = tmp_path / "driver.out"
    with open(out_path, "w") as out:
        driver = subprocess.Popen(
            [sys.executable, str(tmp_path / "driver.py"),
             files["examples/agent_service/run_agent_service.py"], AGENT, "areal-agent-admin",
             str(tmp_path / "fileroot"), json.dumps(agent_env), inf],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO), text=True,
        )  # fmt: skip
        driver.stdin.write("".join(q + "\n" for q in QUESTIONS) + "quit\n")
        driver.stdin.close()
        try:
            with PPOTrainer(cfg, train_dataset=None) as trainer:
                result = trainer.train()
            rc = driver.wait(timeout=120)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    text = out_path.read_text()
    assert rc == 0, text[-4000:]
    assert "Error:" not in text, text[-4000:]
    assert text.count("[tool] set_reward") == 3  # one episode per turn
    assert result["steps_done"] == 3
    rows = _rows(result["log_dir"])
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    assert [r["batch/n_seqs"] for r in rows] == [1, 1, 1]  # the agent's one call a turn
    for r in rows:
        assert r["update_successful"] == 1.0 and math.isfinite(r["ppo_actor/update/loss"])
    # the trained sequences are the agent's calls, with the rewards it set
    dumps = [
        json.loads(line)
        for root, _, names in os.walk(os.path.join(result["log_dir"], "rollout"))
        for name in names
        for line in open(os.path.join(root, name))
        if line.strip()
    ]
    assert len(dumps) == 3, dumps
    seen = []
    for d in dumps:
        question = max(QUESTIONS, key=lambda q: d["prompt"].rfind(q))  # the turn's message
        assert question in d["prompt"]
        assert d["reward"] == arithmetic_reward(question, d["completion"], default=0.5)
        seen.append(question)
    assert sorted(seen) == sorted(QUESTIONS)
    assert sorted(r["batch/reward"] for r in rows) == sorted(d["reward"] for d in dumps)
    assert 0.5 in [r["batch/reward"] for r in rows]  # "Tell me a joke.": the fixed reward


@pytest.mark.parametrize("case", ["half-set", "dead-gateway"])
def test_areal_interactive_loop_prints_the_training_modes_config_error(tmp_path, case):
    """A bad training-mode configuration is the turn's ``error.message`` (2.0's client
    prints it), at once; the next turn gets the same answer (no hang, no crash)."""
    from areal.utils.network import find_free_ports

    files = copy_areal_files(
        str(tmp_path / "ref"), ["examples/agent_service/run_agent_service.py"], ENV_VARS
    )
    (tmp_path / "driver.py").write_text(TRAIN_DRIVER)
    dead = f"http://127.0.0.1:{find_free_ports(1)[0]}"
    env, expected = {
        "half-set": (
            {"AREAL_AGENT_INF_ADMIN_KEY": "k"},
            "ValueError: AREAL_AGENT_INF_ADMIN_KEY is set but AREAL_AGENT_INF_BASE_URL is not",
        ),
        "dead-gateway": (
            {"AREAL_AGENT_INF_BASE_URL": dead, "AREAL_AGENT_INF_ADMIN_KEY": "k"},
            f"RuntimeError: inference gateway unreachable: {dead}/rl/start_session",
        ),
    }[case]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"),
         files["examples/agent_service/run_agent_service.py"], AGENT, "areal-agent-admin",
         str(tmp_path / "fileroot"), json.dumps(env), ""],
        input="What is 1 + 1?\nagain\nquit\n", cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    prefix = f"Error: agent {AGENT} failed: "
    assert out.count(prefix + expected) == 2, out[-3000:]
    assert time.monotonic() - started < 60


HERMES_FILES = (
    "examples/hermes/__init__.py",
    "examples/hermes/hermes.py",
    "examples/hermes/hermes_loop.py",
    "examples/hermes/start_session.py",
    "examples/hermes/set_reward.py",
    "examples/hermes/train.py",
    "examples/hermes/config.yaml",
)
INF_ADMIN = "sk-xxx"  # the YAML's rollout.admin_api_key (v2: the inference gateway's key)
AGENT_ADMIN = "sk-agent-123456"


def _hermes_dir() -> str:
    d = os.environ.get("AREAL_HERMES_DIR") or os.path.join(REPO, ".venv-hermes")
    if not os.path.exists(os.path.join(d, "run_agent.py")):
        pytest.skip(f"hermes-agent is not installed in {d}: run `make hermes-agent`")
    return d


def _long_context_tiny(dest: str) -> str:
    shutil.copytree(TINY_BASE, dest)
    cfg_path = os.path.join(dest, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 8192
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dest


def _read_gateway(proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("gateway "):
            return line.split()[1]
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"areal agent run printed no gateway line (rc {proc.poll()})")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_areal_hermes_example_three_steps_through_our_agent_service(tmp_path):
    from areal.utils.network import find_free_ports

    hermes_dir = _hermes_dir()
    ref = str(tmp_path / "ref")
    files = copy_areal_files(ref, list(HERMES_FILES), ENV_VARS)
    model = _long_context_tiny(str(tmp_path / "tiny-8k"))
    fileroot = str(tmp_path / "fileroot")
    port = find_free_ports(1)[0]
    inf = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    overrides = [
        "rollout.backend=local:d1",
        "actor.backend=fsdp:d1",
        "cluster.n_gpus_per_node=0",
        f"actor.path={model}",
        f"cluster.fileroot={fileroot}",
        f"cluster.name_resolve.nfs_record_root={fileroot}/name_resolve",
        "total_train_steps=3",
        "gconfig.max_new_tokens=16",
        f"rollout.agent.proxy_port={port}",
    ]

    def script(name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, files[f"examples/hermes/{name}"], *args],
            cwd=ref,
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=600,
        )

    def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    train_log = open(tmp_path / "train.log", "w")
    trainer = subprocess.Popen(
        [sys.executable, files["examples/hermes/train.py"], "--config",
         files["examples/hermes/config.yaml"], *overrides],
        cwd=ref, env=env, stdout=train_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    hermes_home = tmp_path / "hermes_home"
    hermes_home.mkdir()
    # Hermes' own config (HERMES_HOME/config.yaml): 16 new tokens a call; Hermes sends no
    # max_tokens otherwise, and a cut reply makes it ask for up to 3 continuations.
    (hermes_home / "config.yaml").write_text("model:\n  max_tokens: 16\n")
    agent_env = dict(
        env,
        PYTHONPATH=os.pathsep.join([REPO, hermes_dir]),
        HERMES_ENABLED_TOOLSETS="none",
        HERMES_MAX_TURNS="2",
        HERMES_HOME=str(hermes_home),
        TMPDIR=str(tmp_path),
    )
    service = subprocess.Popen(
        [sys.executable, "-m", "areal.cli", "agent", "run", "--service", "default",
         "--agent", "examples.hermes.hermes.HermesAgent", "--num-pairs", "1",
         "--admin-api-key", AGENT_ADMIN],
        cwd=ref, env=agent_env, stdout=subprocess.PIPE, stderr=open(tmp_path / "agent.log", "w"),
        text=True,
    )  # fmt: skip
    replies = []
    try:
        gw = _read_gateway(service)
        wait_for_grant(inf, trainer)
        key = None
        for episode in range(3):
            refresh = ["--api-key", key] if key else []
            started = ok(script("start_session.py", inf, "--admin-key", INF_ADMIN, *refresh))
            machine = dict(
                line.split("=", 1)
                for line in started.stderr.splitlines()
                if line.startswith("SESSION_")
            )
            assert key is None or machine["SESSION_API_KEY"] == key  # a refresh keeps it
            key = machine["SESSION_API_KEY"]
            loop = ok(
                script(
                    "hermes_loop.py",
                    gw,
                    "--admin-api-key",
                    AGENT_ADMIN,
                    "--inf-base-url",
                    inf,
                    "--session-api-key",
                    key,
                    stdin=f"What is {episode} + 1?\nquit\n",
                )  # fmt: skip
            )
            assert "Error:" not in loop.stdout, loop.stdout[-3000:]
            replies.append(loop.stdout)
            ok(script("set_reward.py", inf, "--api-key", key, "--reward", "1.0"))
        # the third episode ends with the next refresh (its own grant may come too late)
        script("start_session.py", inf, "--admin-key", INF_ADMIN, "--api-key", key)
        rc = trainer.wait(timeout=600)
    finally:
        for p in (service, trainer):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        train_log.close()
    text = (tmp_path / "train.log").read_text()
    assert rc == 0, text[-6000:]
    assert all("Self-evolution: routing LLM calls via" in r for r in replies)
    log_dir = os.path.join(fileroot, "logs", "online-rl", "trial0")
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["batch/n_seqs"] >= 1  # Hermes' model calls of the episode
        assert r["batch/reward"] == 1.0
        assert math.isfinite(r["ppo_actor/update/loss"])
