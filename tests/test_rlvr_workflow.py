"""RLVRWorkflow against a scripted in-process engine (real tokenizer, real reward fn)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, ModelResponse
from areal.workflow.grouped import GroupedRolloutWorkflow
from areal.workflow.rlvr import RLVRWorkflow

CORPUS = [
    "What is 6 times 7? The answer is 42. #### 42",
    "Natalia sold 48 clips in April and half as many in May. #### 72",
    "Please put your final answer within \\boxed{}.",
] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from areal.models.tiny import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_tok")
    build_tiny_tokenizer(str(out), CORPUS)
    return str(out)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class ScriptedEngine:
    """Answers each request with the next scripted completion text."""

    def __init__(self, tokenizer, completions, version=3, truncate=()):
        self.tokenizer = tokenizer
        self.completions = list(completions)
        self.version = version
        self.truncate = set(truncate)
        self.requests: list[ModelRequest] = []
        self.max_concurrent = 0
        self._in_flight = 0

    def get_version(self):
        return self.version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        i = len(self.requests)
        self.requests.append(req)
        self._in_flight += 1
        self.max_concurrent = max(self.max_concurrent, self._in_flight)
        await asyncio.sleep(0.01)
        self._in_flight -= 1
        ids = self.tokenizer.encode(self.completions[i], add_special_tokens=False)
        stop = "length" if i in self.truncate else "stop"
        if stop == "stop":
            ids = ids + [self.tokenizer.eos_token_id]
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[-0.1 * (k + 1) for k in range(len(ids))],
            output_versions=[self.version] * len(ids),
            stop_reason=stop,
        )


DATA = {
    "messages": [{"role": "user", "content": "What is 6 times 7?"}],
    "answer": "6 * 7 = 42\n#### 42",
    "id": "q1",
}


async def test_one_call_generates_one_trajectory_whatever_n_samples(tokenizer):
    """AReaL semantics: the trainer forms groups; one call is one sample (no n^2 groups)."""
    engine = ScriptedEngine(tokenizer, ["#### 42"] * 8)
    gconfig = GenerationHyperparameters(n_samples=4, max_new_tokens=32)
    wf = RLVRWorkflow("areal.reward.gsm8k.gsm8k_reward_fn", gconfig, tokenizer)
    out = await wf.arun_episode(engine, DATA)
    assert len(engine.requests) == 1 and engine.requests[0].gconfig.n_samples == 1
    # as AReaL: the tokenizer's EOS (and pad) stop generation
    assert tokenizer.eos_token_id in engine.requests[0].gconfig.stop_token_ids
    assert out["input_ids"].shape[0] == 1 and out["rewards"].tolist() == [1.0]


async def test_group_members_get_distinct_reproducible_seeds(tokenizer):
    from areal.utils import seeding

    old = seeding.get_base_seed()
    seeding.set_random_seed(123)
    try:
        wf = RLVRWorkflow(
            "areal.reward.gsm8k.gsm8k_reward_fn", GenerationHyperparameters(), tokenizer
        )
        seeds = []
        for _ in range(2):
            engine = ScriptedEngine(tokenizer, ["#### 42"] * 3)
            await GroupedRolloutWorkflow(wf, 3).arun_episode(engine, DATA)
            seeds.append([r.metadata["seed"] for r in engine.requests])
    finally:
        seeding._BASE_SEED = old
    assert len(set(seeds[0])) == 3 and seeds[0] == seeds[1]


async def test_grouped_rlvr_builds_padded_batch_with_rewards_and_masks(tokenizer, tmp_path):
    completions = ["The answer is 42. #### 42", "#### 41", "I think \\boxed{42}", "no idea"]
    engine = ScriptedEngine(tokenizer, completions, version=3, truncate={3})
    gconfig = GenerationHyperparameters(n_samples=4, max_new_tokens=32)
    wf = RLVRWorkflow(
        "areal.reward.gsm8k.gsm8k_reward_fn", gconfig, tokenizer, dump_dir=str(tmp_path / "dump")
    )
    out = await GroupedRolloutWorkflow(wf, gconfig.n_samples).arun_episode(engine, DATA)

    # 4 separate requests, launched concurrently, each asking for one sample
    assert len(engine.requests) == 4 and engine.max_concurrent == 4
    assert all(r.gconfig.n_samples == 1 for r in engine.requests)
    assert len({r.rid for r in engine.requests}) == 4
    prompt = tokenizer.apply_chat_template(
        DATA["messages"], tokenize=True, add_generation_prompt=True
    )
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    assert engine.requests[0].input_ids == list(prompt)
    P = len(prompt)

    assert out["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["rewards"].dtype == torch.float32
    assert out["no_eos"].tolist() == [False, False, False, True]
    lens = [
        len(tokenizer.encode(c, add_special_tokens=False)) + (0 if i == 3 else 1)
        for i, c in enumerate(completions)
    ]
    assert out["seqlen"].tolist() == [P + n for n in lens]
    B, T = out["input_ids"].shape
    assert B == 4 and T == P + max(lens)
    for i, n in enumerate(lens):
        am = out["attention_mask"][i]
        assert am.dtype == torch.bool and am.sum().item() == P + n
        assert out["input_ids"][i, :P].tolist() == list(prompt)
        lm = out["loss_mask"][i]
        assert lm[:P].sum() == 0 and lm[P : P + n].sum() == n and lm[P + n :].sum() == 0
        v = out["versions"][i]
        assert (v[:P] == -1).all() and (v[P : P + n] == 3).all() and (v[P + n :] == -1).all()
        lp = out["logprobs"][i]
        assert lp.dtype == torch.float32
        assert (lp[:P] == 0).all() and (lp[P + n :] == 0).all()
        assert torch.allclose(lp[P : P + n], torch.tensor([-0.1 * (k + 1) for k in range(n)]))

    # dump written (without blocking) to {dump_dir}/{version}.jsonl
    lines = (tmp_path / "dump" / "3.jsonl").read_text().splitlines()
    rows = sorted((json.loads(x) for x in lines), key=lambda r: r["idx"])
    assert [r["idx"] for r in rows] == [0, 1, 2, 3]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    assert rows[0]["qid"] == "q1" and rows[0]["completion"].startswith("The answer is 42")


async def test_tokenizer_path_and_callable_reward_are_accepted(tokenizer_dir, tokenizer):
    from areal.reward.gsm8k import gsm8k_reward_fn

    engine = ScriptedEngine(tokenizer, ["#### 42"])
    wf = RLVRWorkflow(gsm8k_reward_fn, GenerationHyperparameters(n_samples=1), tokenizer_dir)
    out = await wf.arun_episode(engine, DATA)
    assert out["rewards"].tolist() == [1.0]


async def test_custom_prompt_functions_are_used(tokenizer):
    engine = ScriptedEngine(tokenizer, ["#### 7"])
    seen = {}

    def extract(data):
        return data["question"]

    def to_ids(prompt, tok, enable_thinking):
        seen["args"] = (prompt, enable_thinking)
        return [5, 6, 7]

    wf = RLVRWorkflow(
        "areal.reward.gsm8k.gsm8k_reward_fn",
        GenerationHyperparameters(),
        tokenizer,
        enable_thinking=True,
        get_input_ids_fn=to_ids,
        data_extract_prompt_fn=extract,
    )
    out = await wf.arun_episode(engine, {"question": "q?", "answer": "7"})
    assert seen["args"] == ("q?", True)
    assert engine.requests[0].input_ids == [5, 6, 7]
    assert out["input_ids"][0, :3].tolist() == [5, 6, 7]
    assert out["rewards"].tolist() == [1.0]


async def test_missing_messages_raises_clear_key_error(tokenizer):
    wf = RLVRWorkflow("areal.reward.gsm8k.gsm8k_reward_fn", GenerationHyperparameters(), tokenizer)
    with pytest.raises(KeyError, match="messages"):
        await wf.arun_episode(ScriptedEngine(tokenizer, ["x"]), {"answer": "1"})


async def test_reward_stats_recorded_in_rollout_scope(tokenizer):
    from areal.utils import stats_tracker

    tracker = stats_tracker.get("rlvr_test_scope")
    tracker.export()  # clear
    engine = ScriptedEngine(tokenizer, ["#### 42", "#### 1"])
    wf = RLVRWorkflow(
        "areal.reward.gsm8k.gsm8k_reward_fn",
        GenerationHyperparameters(n_samples=2),
        tokenizer,
        rollout_stat_scope="rlvr_test_scope",
    )
    await GroupedRolloutWorkflow(wf, 2).arun_episode(engine, DATA)
    stats = tracker.export()
    assert stats["rlvr_test_scope/reward"] == pytest.approx(0.5)
    assert stats["rlvr_test_scope/reward__count"] == 2
    assert "rlvr_test_scope/completion_len" in stats


def test_rlvr_through_executor_with_import_strings(tokenizer_dir, tokenizer):
    """Workflow and reward given as import strings, tokenizer as a path (trainer style)."""
    from areal.infra.workflow_executor import WorkflowExecutor

    engine = ScriptedEngine(tokenizer, ["#### 42", "#### 3"] * 4, version=0)
    cfg = InferenceEngineConfig(
        consumer_batch_size=2,
        max_concurrent_rollouts=2,
        max_head_offpolicyness=0,
        queue_size=None,
        check_trajectory_format=True,
        enable_rollout_tracing=False,
    )
    ex = WorkflowExecutor(cfg, engine)
    ex.initialize()
    try:
        kwargs = dict(
            reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
            gconfig=GenerationHyperparameters(n_samples=2, max_new_tokens=8),
            tokenizer=tokenizer_dir,
        )
        batch = ex.prepare_batch(
            [[DATA, DATA]], "areal.workflow.rlvr.RLVRWorkflow", kwargs, group_size=2, timeout=60
        )
    finally:
        ex.destroy()
    assert batch["input_ids"].shape[0] == 4
    assert sorted(batch["rewards"].tolist()) == [0.0, 0.0, 1.0, 1.0]


def test_trajectory_tensors_mismatched_lengths_raise_naming_each():
    from areal.workflow.trajectory import trajectory_tensors

    with pytest.raises(ValueError, match="loss_mask 2, logprobs 3"):
        trajectory_tensors([1, 2, 3], [0, 1], [0.0, 0.1, 0.2], [-1, 0, 0], 1.0, False)
    t = trajectory_tensors([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 3, 4], 0.5, True)
    assert t["input_ids"].tolist() == [[5, 6, 7]] and t["versions"].tolist() == [[-1, 3, 4]]
    assert t["rewards"].tolist() == [0.5] and t["no_eos"].tolist() == [True]
    assert t["attention_mask"].dtype == torch.bool and t["seqlen"].tolist() == [3]


class _CountingTokenizer:
    """The real tokenizer, counting chat-template calls."""

    def __init__(self, tok):
        self._tok, self.template_calls = tok, 0

    def apply_chat_template(self, *args, **kwargs):
        self.template_calls += 1
        return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


async def test_group_tokenizes_its_prompt_once_and_other_prompts_get_their_own_ids(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    wf = RLVRWorkflow("areal.reward.gsm8k.gsm8k_reward_fn", GenerationHyperparameters(), counting)
    engine = ScriptedEngine(tokenizer, ["#### 42"] * 4 + ["#### 72"] * 4)
    other = {
        "messages": [{"role": "user", "content": "Natalia sold 48 clips in April."}],
        "answer": "#### 72",
    }
    a = await GroupedRolloutWorkflow(wf, 4).arun_episode(engine, DATA)
    b = await GroupedRolloutWorkflow(wf, 4).arun_episode(engine, other)
    assert counting.template_calls == 2  # one per distinct prompt, not one per sample
    for data, out in ((DATA, a), (other, b)):
        want = tokenizer.apply_chat_template(data["messages"], add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        for row in range(4):
            got = out["input_ids"][row][: len(want)].tolist()
            assert got == list(want)
    assert a["rewards"].tolist() == [1.0] * 4 and b["rewards"].tolist() == [1.0] * 4
