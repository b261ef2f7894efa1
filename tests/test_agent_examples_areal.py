"""AReaL's own agent examples, unchanged, 3 steps each on CPU.

- ``examples/agent_workflow/train.py`` + ``config.yaml`` (the YAML's
  ``workflow: areal.workflow.openai.math_agent.MathAgent`` through the proxy);
- ``examples/openai_agents/train_agents.py`` + ``config.yaml`` (an openai-agents ``Agent``
  from ``areal.workflow.openai_agent.math_agent.build_math_agent`` on ``ArealOpenAI``,
  exported one row per model call);
- ``examples/tir/train_tir.py`` + ``tir_math_config.yaml`` (tool-integrated reasoning, its
  ``TIRWorkflow`` with the Python tool, ``qwen_agent`` + ``json5``).

Opt-in: set ``AREAL_CHECKOUT`` (or ``AREAL_REFERENCE_DIR``) to an AReaL checkout, a work
tree or a bare git directory whose ``HEAD`` is read. Each example's files are copied out
of it into a temporary directory (never into this repository), laid out as in AReaL's
repository (``examples/<name>/...``; the copy's root is on ``PYTHONPATH``, as AReaL's
repository root is when its scripts name ``examples.<name>....`` workflows), and run with
command-line overrides only: backends, CPU, a shipped tiny model, synthetic problems,
sizes; for ``openai_agents`` also ``agent_builder_kwargs`` (the tiny tool model's agent)
and a lower temperature; for ``tir`` the ``tir`` section (the tiny models' context).
``docs/areal_compat.md`` gives the commands.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from _areal_checkout import copy_areal_files

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ASSETS = os.path.join(REPO, "areal", "models", "assets")
BS, N = 2, 4  # train_dataset.batch_size override; gconfig.n_samples of every YAML

pytestmark = [pytest.mark.slow, pytest.mark.areal_checkout, pytest.mark.timeout(1200)]


@dataclass
class Example:
    files: tuple[str, ...]
    script: str
    config: str
    log_dir: str  # experiment_name/trial_name of the YAML
    model: str
    digits: int
    overrides: tuple[str, ...]
    calls_per_episode: int  # the largest number of model calls (rows) of one episode
    learns: bool  # rewards vary within a batch: a non-zero gradient


EXAMPLES = {
    "agent_workflow": Example(
        files=(
            "examples/agent_workflow/train.py",
            "examples/agent_workflow/configs.py",
            "examples/agent_workflow/config.yaml",
        ),
        script="examples/agent_workflow/train.py",
        config="examples/agent_workflow/config.yaml",
        log_dir="gsm8k-grpo/trial0",
        model="tiny-base",
        digits=1,
        overrides=("gconfig.max_new_tokens=32", "gconfig.max_tokens=512"),
        calls_per_episode=1,
        learns=True,
    ),
    "openai_agents": Example(
        files=(
            "examples/openai_agents/train_agents.py",
            "examples/openai_agents/config.py",
            "examples/openai_agents/config.yaml",
        ),
        script="examples/openai_agents/train_agents.py",
        config="examples/openai_agents/config.yaml",
        log_dir="openai-agents-gsm8k-grpo/trial0",
        model="tiny-tool",
        digits=2,
        overrides=(
            "gconfig.max_new_tokens=48",
            "gconfig.max_tokens=48",  # the example's ModelSettings(max_tokens=...)
            "gconfig.temperature=0.3",
            "agent_builder_kwargs.tools=[calculator]",
            "agent_builder_kwargs.instructions=false",
            "agent_builder_kwargs.handoffs=false",
        ),
        calls_per_episode=2,  # the calculator call, then the answer (the SDK's tool loop)
        learns=True,
    ),
    "tir": Example(
        files=(
            "examples/tir/train_tir.py",
            "examples/tir/tir_workflow.py",
            "examples/tir/prompts.py",
            "examples/tir/tool_manager.py",
            "examples/tir/tir_math_config.yaml",
            "examples/tir/tools/__init__.py",
            "examples/tir/tools/base.py",
            "examples/tir/tools/calculator_tool.py",
            "examples/tir/tools/python_tool.py",
            "examples/tir/tools/daytona_python_tool.py",
        ),
        script="examples/tir/train_tir.py",
        config="examples/tir/tir_math_config.yaml",
        log_dir="tir-math-reasoning/tir-math-reasoning",
        model="tiny-base",
        digits=1,
        overrides=(
            "gconfig.max_new_tokens=32",
            # the Python tool's system prompt (916 tokens) fits the tiny model's 1,024
            "tir.enable_tools=python",
            "tir.is_chat_model=true",
            "tir.max_length=1000",
        ),
        calls_per_episode=1,  # TIRWorkflow returns one row per episode
        learns=False,  # after a 916-token prompt the tiny models rarely answer right
    ),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_areal_agent_example_runs_three_steps_unchanged(name, tmp_path):
    ex = EXAMPLES[name]
    root = str(tmp_path / "areal_ref")
    copy_areal_files(root, list(ex.files), ("AREAL_CHECKOUT", "AREAL_REFERENCE_DIR"))
    fileroot = str(tmp_path / "fileroot")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, REPO]))
    arith = f"synthetic://arith?digits={ex.digits}&steps=2"
    cmd = [
        sys.executable,
        os.path.join(root, ex.script),
        "--config",
        os.path.join(root, ex.config),
        "rollout.backend=local:d1",
        "actor.backend=fsdp:d1",
        "cluster.n_gpus_per_node=0",
        f"actor.path={os.path.join(ASSETS, ex.model)}",
        f"cluster.fileroot={fileroot}",
        "total_train_steps=3",
        f"train_dataset.path={arith}&n=200&seed=0",
        f"valid_dataset.path={arith}&n=8&seed=1",
        f"train_dataset.batch_size={BS}",
        "valid_dataset.batch_size=4",
        "train_dataset.num_workers=0",
        "valid_dataset.num_workers=0",
        *ex.overrides,
    ]
    proc = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1000, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    log_dir = os.path.join(fileroot, "logs", ex.log_dir)
    with open(os.path.join(log_dir, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["global_step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert math.isfinite(r["ppo_actor/update/loss"])
        # one row per model call: BS x N episodes, each 1..calls_per_episode calls
        assert BS * N <= r["batch/n_seqs"] <= BS * N * ex.calls_per_episode
    if ex.calls_per_episode > 1:  # multi-call episodes did happen, one row per call
        assert max(r["batch/n_seqs"] for r in rows) > BS * N
    if ex.learns:  # some step had a reward signal, so the weights moved
        assert any(r["ppo_actor/update/grad_norm"] > 0 for r in rows), rows
        assert any(r["batch/reward"] > 0 for r in rows)
    print(
        json.dumps(
            {
                "example": name,
                "reward": [r["batch/reward"] for r in rows],
                "n_seqs": [r["batch/n_seqs"] for r in rows],
                "loss": [r["ppo_actor/update/loss"] for r in rows],
                "grad_norm": [r["ppo_actor/update/grad_norm"] for r in rows],
            }
        )
    )
