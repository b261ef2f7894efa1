"""WorkflowExecutor + RLVRWorkflow against the REAL built-in inference server (tiny model).

Needs ``areal.infra.remote_inf_engine.RemoteInfEngine`` and
``areal.inference.server.launch.launch_local_server``; skipped only when those modules
are missing.
"""

from __future__ import annotations

import pytest
import torch

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.infra.workflow_executor import WorkflowExecutor
from areal.workflow.rlvr import RLVRWorkflow

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CORPUS = ["What is 3 plus 4? The answer is 7. #### 7", "Compute 12 minus 5. #### 7"] * 20
GCONFIG = GenerationHyperparameters(n_samples=2, max_new_tokens=6, temperature=1.0)


def _messages(i: int):
    return [{"role": "user", "content": f"What is {i} plus {i % 7}?"}]


def make_loader(n: int, batch: int, **extra):
    items = [dict(uid=i, messages=_messages(i), answer=str(i + i % 7), **extra) for i in range(n)]
    return [items[k : k + batch] for k in range(0, n, batch)]


# module-level (picklable) reward: 1 when the first generated token id is even; "flat"
# items always get 0 so that their whole group has equal rewards.
def parity_reward_fn(prompt, completions, prompt_ids, completion_ids, kind="", **kwargs) -> float:
    if kind == "flat" or not completion_ids:
        return 0.0
    return float(completion_ids[0] % 2 == 0)


def dapo_filter(trajectory) -> bool:
    r = trajectory["rewards"]
    return bool((r != r[0]).any())


class FlakyRLVR(RLVRWorkflow):
    """Raises on every 10th input."""

    async def arun_episode(self, engine, data):
        if data["uid"] % 10 == 0:
            raise RuntimeError(f"flaky workflow fails on uid {data['uid']}")
        return await super().arun_episode(engine, data)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import build_tiny_qwen2

    from areal.models.tiny import TINY_VOCAB_SIZE, build_tiny_tokenizer

    path = str(tmp_path_factory.mktemp("tiny_rl_model"))
    build_tiny_qwen2(path, vocab_size=TINY_VOCAB_SIZE)
    build_tiny_tokenizer(path, CORPUS)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from areal.inference.clients.local import RemoteLocalEngine

    eng = RemoteLocalEngine(InferenceEngineConfig(setup_timeout=120))
    eng.launch_server({"model_path": model_dir, "num_servers": 1})
    eng.initialize()
    try:
        yield eng
    finally:
        eng.destroy()
        eng.teardown_server()


@pytest.fixture
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def executor(engine, **cfg) -> WorkflowExecutor:
    engine.set_version(0)
    ex = WorkflowExecutor(InferenceEngineConfig(**cfg), engine)
    ex.initialize()
    return ex


def _check_batch(batch, n_rows: int, version: int, eta: int):
    ids, am, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    assert ids.shape[0] == n_rows
    for k in ("attention_mask", "loss_mask", "logprobs", "versions"):
        assert batch[k].shape == ids.shape, k
    # right padding; generated tokens are real tokens after the prompt
    assert (am.int().diff(dim=1) <= 0).all()
    assert (lm & ~am).sum() == 0
    assert (lm.sum(1) > 0).all() and (lm.sum(1) <= GCONFIG.max_new_tokens).all()
    assert (batch["seqlen"] == am.sum(1)).all()
    # prompt and padding: version -1, logprob 0; generated: version in [v - eta, v]
    assert (batch["versions"][~lm] == -1).all()
    assert (batch["logprobs"][~lm] == 0).all()
    gen_v = batch["versions"][lm]
    assert (gen_v >= version - eta).all() and (gen_v <= version).all()
    assert (batch["logprobs"][lm] <= 0).all()
    assert batch["rewards"].shape == (n_rows,) and batch["rewards"].dtype == torch.float32


def test_prepare_batch_real_server_returns_exact_batches_with_masks_and_versions(engine, tokenizer):
    eta, bs = 1, 3
    ex = executor(
        engine,
        consumer_batch_size=bs,
        max_concurrent_rollouts=4,
        max_head_offpolicyness=eta,
        check_trajectory_format=True,
    )
    wf = RLVRWorkflow(parity_reward_fn, GCONFIG, tokenizer)
    loader = make_loader(12, 4)
    try:
        for _step in range(3):
            batch = ex.prepare_batch(loader, wf, group_size=GCONFIG.n_samples, timeout=120)
            v = engine.get_version()
            _check_batch(batch, bs * GCONFIG.n_samples, v, eta)
            assert len(ex.last_submit_versions) == bs
            assert all(0 <= v - sv <= eta for sv in ex.last_submit_versions)
            engine.set_version(v + 1)
    finally:
        ex.destroy()
    assert ex.rejection_reasons.get("error", 0) == 0


def test_real_server_workflow_raising_on_10_percent_does_not_stall(engine, tokenizer):
    ex = executor(
        engine, consumer_batch_size=4, max_concurrent_rollouts=6, max_head_offpolicyness=1
    )
    wf = FlakyRLVR(parity_reward_fn, GCONFIG, tokenizer)
    loader = make_loader(30, 5)
    rows = []
    try:
        for _step in range(4):
            batch = ex.prepare_batch(loader, wf, group_size=GCONFIG.n_samples, timeout=120)
            _check_batch(batch, 4 * GCONFIG.n_samples, engine.get_version(), 1)
            rows.append(batch["input_ids"].shape[0])
            engine.set_version(engine.get_version() + 1)
    finally:
        ex.destroy()
    assert rows == [8, 8, 8, 8]
    assert ex.rejection_reasons.get("error", 0) >= 1  # uid 0 (and 10, ...) failed


def test_real_server_dapo_filter_replaces_all_equal_groups(engine, tokenizer):
    # half the prompts are "flat": without the per-step bound (max_num_gen_batches), so
    # that every all-equal group is replaced however many it takes
    ex = executor(
        engine,
        consumer_batch_size=3,
        max_concurrent_rollouts=6,
        max_head_offpolicyness=0,
        max_num_gen_batches=None,
    )
    wf = RLVRWorkflow(parity_reward_fn, GCONFIG.new(n_samples=4), tokenizer)
    loader = make_loader(8, 4)
    for batch in loader[:1]:  # the first 4 prompts are "flat": rewards all 0
        for item in batch:
            item["kind"] = "flat"
    try:
        for _step in range(2):
            batch = ex.prepare_batch(
                loader, wf, should_accept_fn=dapo_filter, group_size=4, timeout=120
            )
            groups = batch["rewards"].view(3, 4)
            assert all(not torch.all(g == g[0]) for g in groups)
            engine.set_version(engine.get_version() + 1)
    finally:
        ex.destroy()
    assert ex.rejection_reasons.get("filtered", 0) >= 4


def test_real_server_wait_timeout_reports_counts(engine, tokenizer):
    ex = executor(
        engine, consumer_batch_size=2, max_concurrent_rollouts=1, max_head_offpolicyness=0
    )
    slow = GenerationHyperparameters(n_samples=1, max_new_tokens=400, ignore_eos=True)
    wf = RLVRWorkflow(parity_reward_fn, slow, tokenizer)
    # generation paused: the first rollout stays running whatever the server's speed
    engine.pause_generation()
    try:
        for item in make_loader(2, 2)[0]:
            ex.submit(item, wf)
        with pytest.raises(TimeoutError, match=r"0 arrived, 1 running, 1 queued"):
            ex.wait(2, timeout=0.5)
    finally:
        engine.continue_generation()
        ex.destroy()


def test_remote_engine_delegates_rollout_batch_to_its_executor(engine, tokenizer):
    engine.set_version(0)
    ex = engine.workflow_executor
    assert isinstance(ex, WorkflowExecutor) and ex.consumer_batch_size == 1
    before = ex.get_stats().accepted
    item = make_loader(1, 1)[0]
    batch = engine.rollout_batch(
        item,
        "areal.workflow.rlvr.RLVRWorkflow",
        dict(reward_fn=parity_reward_fn, gconfig=GCONFIG, tokenizer=tokenizer),
        group_size=GCONFIG.n_samples,
        timeout=120,
    )
    _check_batch(batch, GCONFIG.n_samples, 0, 0)
    assert ex.get_stats().accepted == before + 1
