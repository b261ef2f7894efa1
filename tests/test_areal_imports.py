"""The import paths AReaL users write resolve here, with AReaL's names and call shapes.

The list below is ours: the ``from areal... import X`` an AReaL user's scripts,
workflows and the AReaL docs use (found with ``tools/check_areal_imports.py`` against an
AReaL checkout), minus Megatron/Archon/NPU-only code.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import subprocess
import sys

import pytest

# (module, name): "from module import name"; name "" means "import module".
EXPECTED = [
    # top level
    ("areal", "PPOTrainer"),
    ("areal", "SFTTrainer"),
    ("areal", "workflow_context"),
    ("areal", "StalenessManager"),
    ("areal", "WorkflowExecutor"),
    ("areal", "TrainController"),
    # contracts
    ("areal.api", "RolloutWorkflow"),
    ("areal.api", "AsyncRewardWrapper"),
    ("areal.api", "InferenceEngine"),
    ("areal.api", "TrainEngine"),
    ("areal.api", "ModelRequest"),
    ("areal.api", "ModelResponse"),
    ("areal.api", "ModelAllocation"),
    ("areal.api", "FinetuneSpec"),
    ("areal.api", "StepInfo"),
    ("areal.api", "WeightUpdateMeta"),
    ("areal.api.alloc_mode", "AllocationMode"),
    ("areal.api.alloc_mode", "ModelAllocation"),
    ("areal.api.cli_args", "GRPOConfig"),
    ("areal.api.cli_args", "PPOConfig"),
    ("areal.api.cli_args", "SFTConfig"),
    ("areal.api.cli_args", "GenerationHyperparameters"),
    ("areal.api.cli_args", "InferenceEngineConfig"),
    ("areal.api.cli_args", "MicroBatchSpec"),
    ("areal.api.cli_args", "SGLangConfig"),
    ("areal.api.cli_args", "vLLMConfig"),
    ("areal.api.cli_args", "SchedulingSpec"),
    ("areal.api.cli_args", "BaseExperimentConfig"),
    ("areal.api.cli_args", "TrainDatasetConfig"),
    ("areal.api.cli_args", "load_expr_config"),
    ("areal.api.engine_api", "InferenceEngine"),
    ("areal.api.io_struct", "ModelResponse"),
    ("areal.api.reward_api", "AsyncRewardWrapper"),
    ("areal.api.workflow_api", "RolloutWorkflow"),
    # datasets, rewards, workflows
    ("areal.dataset", "get_custom_dataset"),
    ("areal.reward", "get_math_verify_worker"),
    ("areal.workflow", "RLVRWorkflow"),
    ("areal.workflow", "MultiTurnWorkflow"),
    ("areal.workflow.rlvr", "RLVRWorkflow"),
    # the agent modules AReaL's agent example configs name (``workflow: ...``)
    ("areal.workflow.openai.math_agent", "MathAgent"),
    ("areal.workflow.openai.math_agent", "MultiTurnMathAgent"),
    ("areal.workflow.openai.math_agent", "MathToolAgent"),
    ("areal.workflow.openai_agent.math_agent", "build_math_agent"),
    ("areal.workflow.anthropic", "MathAgent"),
    ("areal.workflow.anthropic", "MathToolAgent"),
    ("areal.workflow.anthropic.math_agent", "MathAgent"),
    ("areal.workflow.anthropic.claude_math_agent", "MathToolAgent"),
    ("areal.workflow.langchain", "MathAgent"),
    ("areal.workflow.langchain", "MathToolAgent"),
    ("areal.workflow.langchain.math_agent", "MathAgent"),
    ("areal.workflow.langchain.math_agent", "MathToolAgent"),
    # engines
    ("areal.engine", "RemoteSGLangEngine"),
    ("areal.engine", "RemotevLLMEngine"),
    ("areal.inference.clients.sglang", "RemoteSGLangEngine"),
    ("areal.inference.clients.vllm", "RemotevLLMEngine"),
    # infra
    ("areal.infra", "LocalScheduler"),
    ("areal.infra", "RayScheduler"),
    ("areal.infra", "SlurmScheduler"),
    ("areal.infra", "workflow_context"),
    ("areal.infra", "WorkflowExecutor"),
    ("areal.infra", "StalenessManager"),
    ("areal.infra.scheduler.local", "LocalScheduler"),
    ("areal.infra.scheduler.slurm", "SlurmScheduler"),
    ("areal.infra.async_task_runner", "AsyncTaskRunner"),
    ("areal.infra.workflow_context", "WorkflowContext"),
    # trainers
    ("areal.trainer", "PPOTrainer"),
    ("areal.trainer", "SFTTrainer"),
    ("areal.trainer.ppo", "PPOActor"),
    ("areal.trainer.ppo", "PPOCritic"),
    ("areal.trainer.ppo", "PPOActorController"),
    ("areal.trainer.ppo", "FSDPPPOActor"),
    # utils
    ("areal.utils", "logging"),
    ("areal.utils", "network"),
    ("areal.utils", "seeding"),
    ("areal.utils", "stats_tracker"),
    ("areal.utils", "perf_tracer"),
    ("areal.utils.dataloader", "create_dataloader"),
    ("areal.utils.dynamic_import", "import_from_string"),
    ("areal.utils.environ", "is_single_controller"),
    ("areal.utils.hf_utils", "apply_chat_template"),
    ("areal.utils.hf_utils", "load_hf_tokenizer"),
    ("areal.utils.hf_utils", "load_hf_processor_and_tokenizer"),
    ("areal.utils.perf_tracer", "Category"),
    ("areal.utils.perf_tracer", "atrace_scope"),
    ("areal.utils.perf_tracer", "atrace_session_phase"),
    ("areal.utils.perf_tracer", "session_context"),
    ("areal.utils.perf_tracer", "trace_perf"),
    ("areal.utils.perf_tracer", "trace_scope"),
    ("areal.utils.perf_tracer", "trace_session"),
    ("areal.utils.perf_tracer", "trace_session_event"),
    ("areal.utils.printing", "tabulate_stats"),
    ("areal.utils.proc", "kill_process_tree"),
    ("areal.utils.stats_logger", "StatsLogger"),
    # agents
    ("areal.experimental.openai", "ArealOpenAI"),
    ("areal.experimental.openai.types", "InteractionWithTokenLogpReward"),
    ("areal.experimental.openai.cache", "InteractionCache"),
    ("areal.api.workflow_api", "AgentWorkflow"),
    # alignment trainers
    ("areal", "DPOTrainer"),
    ("areal", "RWTrainer"),
    # cli_args exposes the dataclass helpers
    ("areal.api.cli_args", "dataclass"),
    ("areal.api.cli_args", "field"),
    # AReaL 2.0's agent service (examples/agent_service, examples/hermes)
    ("areal.v2.agent_service.controller", "AgentController"),
    ("areal.v2.agent_service.types", "AgentRequest"),
    ("areal.v2.agent_service.types", "AgentResponse"),
    ("areal.v2.agent_service.types", "EventEmitter"),
    ("areal.v2.agent_service.types", "StreamResponse"),
    ("areal.v2.agent_service.types", "AgentRunnable"),
]


def _resolve(module: str, name: str):
    mod = importlib.import_module(module)
    if not name:
        return mod
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")


@pytest.mark.parametrize(("module", "name"), EXPECTED, ids=[f"{m}:{n}" for m, n in EXPECTED])
def test_areal_import_path_resolves(module, name):
    assert _resolve(module, name) is not None


def test_import_areal_stays_light():
    """``import areal`` (and areal.api / areal.infra) must not pull torch or transformers."""
    code = (
        "import sys, areal, areal.api, areal.infra, areal.workflow;"
        "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_from_areal_import_workflow_context_is_the_module():
    from areal import workflow_context
    from areal.infra import workflow_context as wc2

    assert workflow_context is wc2
    assert workflow_context.stat_scope() == "rollout"


# ---------------------------------------------------------------- AReaL call shapes
def test_set_random_seed_with_key_gives_per_key_streams():
    import random

    from areal.utils import seeding

    seeding.set_random_seed(7, key="trainer0")
    a = random.random()
    seed0 = seeding.get_seed()
    seeding.set_random_seed(7, key="trainer1")
    b = random.random()
    seeding.set_random_seed(7, key="trainer0")
    assert random.random() == a and a != b and seeding.get_seed() == seed0
    assert seeding.get_base_seed() == 7  # request seeds do not depend on the key
    s1, s2 = seeding.get_shuffle_seed(), seeding.get_shuffle_seed()
    assert s1 != s2


def test_model_allocation_from_str_name_keyword():
    from areal.api.alloc_mode import ModelAllocation

    alloc = ModelAllocation.from_str("vllm:d2t2", name="rollout")
    assert (alloc.backend, alloc.name, alloc.parallel.tp_size) == ("vllm", "rollout", 2)


def test_create_dataloader_accepts_areal_positional_order():
    from areal.api.cli_args import DatasetConfig
    from areal.utils.dataloader import create_dataloader

    cfg = DatasetConfig(path="x", type="rl", batch_size=2, shuffle=False)
    rows = [{"i": i} for i in range(6)]
    ours = [b for b in create_dataloader(rows, cfg, 1, 2, seed=0)]
    areal_order = [b for b in create_dataloader(rows, 1, 2, cfg)]
    assert ours == areal_order and [r["i"] for r in ours[0]] == [1, 3]


def test_apply_chat_template_returns_flat_ids(tmp_path):
    from areal.utils.hf_utils import apply_chat_template, load_hf_tokenizer

    root = os.path.join(os.path.dirname(__file__), "..", "areal", "models", "assets", "tiny-base")
    tok = load_hf_tokenizer(root)
    msgs = [{"role": "user", "content": "1 + 2"}]
    ids = apply_chat_template(tok, msgs, tokenize=True, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    text = apply_chat_template(tok, msgs, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == text


def test_tabulate_stats_lays_out_all_pairs():
    from areal.utils.printing import tabulate_stats

    table = tabulate_stats({"eval/reward": 0.5, "eval/n": 8, "a": 1.0}, col=2)
    assert "eval/reward" in table and "5.0000e-01" in table and "| 8 " in table
    assert len(table.splitlines()) == 5  # rule, row, rule, row, rule


def test_is_single_controller_true():
    from areal.utils.environ import is_single_controller

    assert is_single_controller() is True


def test_setup_file_logging_writes_records(tmp_path):
    from areal.utils import logging

    path = logging.setup_file_logging(str(tmp_path), "main.log")
    logging.getLogger("ImportTest").warning("hello file")
    for h in logging.getLogger("ImportTest").parent.handlers:
        h.flush()
    assert "hello file" in open(path).read()
    assert logging.setup_file_logging(str(tmp_path), "main.log") == path  # idempotent


def test_kill_process_tree_kills_children():
    import psutil

    from areal.utils.proc import kill_process_tree

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys,time; "
         "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"]
    )  # fmt: skip
    try:
        deadline = __import__("time").monotonic() + 10
        while (
            not psutil.Process(parent.pid).children() and __import__("time").monotonic() < deadline
        ):
            __import__("time").sleep(0.05)
        children = psutil.Process(parent.pid).children(recursive=True)
        assert children
        kill_process_tree(parent.pid, timeout=5, graceful=True)
        parent.wait(timeout=5)
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_perf_tracer_decorators_run_and_save_when_configured(tmp_path):
    import json

    from areal.api.cli_args import PerfTracerConfig
    from areal.utils import perf_tracer
    from areal.utils.perf_tracer import Category, atrace_scope, session_context, trace_perf

    @trace_perf("double", category=Category.COMPUTE)
    def double(x):
        return 2 * x

    @session_context()
    async def episode():
        async with atrace_scope("tool", Category.IO, args={"k": 1}):
            await asyncio.sleep(0)
        return 3

    assert double(2) == 4 and asyncio.run(episode()) == 3  # no-ops when not configured
    assert perf_tracer.save() is None
    perf_tracer.configure(PerfTracerConfig(enabled=True), rank=0, save_dir=str(tmp_path))
    try:
        double(1)
        asyncio.run(episode())
        path = perf_tracer.save(force=True)
    finally:
        perf_tracer.reset()
    names = {e["name"] for e in json.load(open(path))["traceEvents"]}
    assert {"double", "tool", "session.episode"} <= names


def test_async_task_runner_areal_usage():
    from areal.infra.async_task_runner import AsyncTaskRunner, TaskQueueFullError

    async def work(i, scale=1):
        await asyncio.sleep(0.01 * (3 - i % 3))
        if i == 4:
            raise RuntimeError("boom")
        return i * scale

    runner = AsyncTaskRunner(max_queue_size=8)
    runner.initialize()
    try:
        for i in range(6):
            runner.submit(work, i, task_id=i, scale=10)
        results = runner.wait(count=6, timeout=10)
        assert sorted(r for r in results if r is not None) == [0, 10, 20, 30, 50]
        assert results.count(None) == 1  # the failing task yields None
        timed = None
        runner.submit(work, 1, task_id=100)
        (timed,) = runner.wait(1, timeout=10, with_timing=True)
        assert timed.task_id == 100 and timed.data == 1 and timed.create_time > 0
        runner.pause()
        runner.submit(work, 2, task_id=200)
        with pytest.raises(TimeoutError):
            runner.wait(1, timeout=0.3)
        runner.resume()
        assert runner.wait(1, timeout=10) == [2]
        with pytest.raises(ValueError, match="Duplicate"):
            runner.pause()
            runner.submit(work, 0, task_id=300)
            runner.submit(work, 0, task_id=300)
    finally:
        runner.destroy()
    small = AsyncTaskRunner(max_queue_size=1)
    small.initialize()
    small.pause()
    try:
        small.submit(work, 0, task_id=1)
        with pytest.raises(TaskQueueFullError):
            small.submit(work, 0, task_id=2)
    finally:
        small.destroy()


def test_rlvr_workflow_signature_matches_areal_order():
    from areal.workflow.rlvr import RLVRWorkflow

    params = list(inspect.signature(RLVRWorkflow.__init__).parameters)[1:7]
    assert params == [
        "reward_fn",
        "gconfig",
        "tokenizer",
        "enable_thinking",
        "get_input_ids_fn",
        "data_extract_prompt_fn",
    ]


def test_ppo_trainer_train_signature_matches_areal_order():
    from areal.trainer.rl_trainer import PPOTrainer

    params = list(inspect.signature(PPOTrainer.train).parameters)[1:7]
    assert params == [
        "workflow",
        "eval_workflow",
        "workflow_kwargs",
        "eval_workflow_kwargs",
        "dynamic_filter_fn",
        "total_epochs",
    ]


def test_agent_workflow_subclass_warns_deprecated_and_needs_run():
    import warnings

    from areal.api.workflow_api import AgentWorkflow

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Agent(AgentWorkflow):
            async def run(self, data, **extra_kwargs):
                return 1.0

    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert asyncio.run(Agent().run({})) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        class NoRun(AgentWorkflow):
            pass

    with pytest.raises(TypeError):
        NoRun()
