"""MultiTurnWorkflow against a REAL built-in inference server (random tiny model + tiny tokenizer).

The engine is wrapped by a recorder that forwards every request to the real server and
keeps the (request, response) pairs, so the trajectory can be checked token by token
against what the server returned.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from _local_engine import local_engine

from areal.api.cli_args import GenerationHyperparameters
from areal.workflow.multi_turn import FEEDBACK, MultiTurnWorkflow, feedback_prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GCONFIG = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
DATA = {"messages": [{"role": "user", "content": "Mia has 3 apples. How many?"}], "answer": "3"}


# Module-level (picklable) reward functions: they run in AsyncRewardWrapper's process pool.
def never_reward_fn(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    return 0.0


def succeed_at_turn_reward_fn(
    prompt, completions, prompt_ids, completion_ids, succeed_at=1, **kwargs
) -> float:
    """1.0 from turn ``succeed_at`` on: the turn is 1 + the feedback turns in the prompt."""
    turn = 1 + prompt.count("try to answer it again")
    return 1.0 if turn >= int(succeed_at) else 0.0


class RecordingEngine:
    """Forwards to a real engine; records (request, response); may bump the version."""

    def __init__(self, engine, bump_version_after_first: int | None = None):
        self.engine = engine
        self.calls = []
        self.bump = bump_version_after_first

    def get_version(self):
        return self.engine.get_version()

    async def agenerate(self, req):
        resp = await self.engine.agenerate(req)
        self.calls.append((req, resp))
        if self.bump is not None and len(self.calls) == 1:
            await asyncio.to_thread(self.engine.set_version, self.bump)
        return resp


@pytest.fixture(scope="module")
def engine(tiny_lm_dir):
    with local_engine(tiny_lm_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def tokenizer(tiny_lm_dir):
    from areal.utils.hf_utils import load_hf_tokenizer

    return load_hf_tokenizer(tiny_lm_dir)


def _check_trajectory(out, calls, tokenizer):
    """Token-exact: the row is prompt + answer_1 + (EOS) + feedback + answer_2 + ..."""
    fb = feedback_prompt_ids(tokenizer)
    eos = tokenizer.eos_token_id
    ids = out["input_ids"][0].tolist()
    lm, lp, ver = out["loss_mask"][0], out["logprobs"][0], out["versions"][0]
    expect_ids, expect_mask, expect_lp, expect_ver = [], [], [], []
    prompt = tokenizer.apply_chat_template(
        DATA["messages"], tokenize=True, add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    for k, (req, resp) in enumerate(calls):
        if k == 0:
            assert req.input_ids == prompt
            expect_ids += req.input_ids
            expect_mask += [0] * len(req.input_ids)
            expect_lp += [0.0] * len(req.input_ids)
            expect_ver += [-1] * len(req.input_ids)
        else:  # each request is exactly the sequence built so far (no re-tokenisation)
            assert req.input_ids == expect_ids
        expect_ids += resp.output_tokens
        expect_mask += [1] * resp.output_len
        expect_lp += resp.output_logprobs
        expect_ver += resp.output_versions
        if k + 1 < len(calls):
            extra = ([] if resp.output_tokens[-1:] == [eos] else [eos]) + fb
            expect_ids += extra
            expect_mask += [0] * len(extra)
            expect_lp += [0.0] * len(extra)
            expect_ver += [-1] * len(extra)
    assert ids == expect_ids
    assert lm.tolist() == expect_mask
    assert out["attention_mask"].all() and out["seqlen"].tolist() == [len(ids)]
    torch.testing.assert_close(lp, torch.tensor(expect_lp, dtype=torch.float32))
    assert ver.tolist() == expect_ver
    # nothing but generated tokens is trained on
    assert int(lm.sum()) == sum(resp.output_len for _, resp in calls)


async def test_failing_answers_stop_at_max_turns_with_exact_masks(engine, tokenizer):
    rec = RecordingEngine(engine)
    wf = MultiTurnWorkflow(never_reward_fn, GCONFIG, tokenizer, max_turns=3, turn_discount=0.9)
    out = await wf.arun_episode(rec, DATA)
    assert len(rec.calls) == 3
    assert out["rewards"].tolist() == [0.0]
    _check_trajectory(out, rec.calls, tokenizer)
    # the feedback turn is really in the conversation the model saw
    text = tokenizer.decode(rec.calls[-1][0].input_ids)
    assert text.count(FEEDBACK) == 2
    assert out["no_eos"].tolist() == [rec.calls[-1][1].stop_reason == "length"]


async def test_success_on_second_turn_reward_discounted_once(engine, tokenizer):
    rec = RecordingEngine(engine)
    wf = MultiTurnWorkflow(
        succeed_at_turn_reward_fn, GCONFIG, tokenizer, max_turns=4, turn_discount=0.5
    )
    out = await wf.arun_episode(rec, {**DATA, "succeed_at": 2})
    assert len(rec.calls) == 2
    assert out["rewards"].tolist() == [0.5]
    _check_trajectory(out, rec.calls, tokenizer)


async def test_success_on_third_turn_reward_discounted_twice(engine, tokenizer):
    rec = RecordingEngine(engine)
    wf = MultiTurnWorkflow(
        succeed_at_turn_reward_fn, GCONFIG, tokenizer, max_turns=5, turn_discount=0.8
    )
    out = await wf.arun_episode(rec, {**DATA, "succeed_at": 3})
    assert len(rec.calls) == 3
    assert out["rewards"].item() == pytest.approx(0.64)


async def test_success_on_first_turn_is_single_turn_undiscounted(engine, tokenizer):
    rec = RecordingEngine(engine)
    wf = MultiTurnWorkflow(
        succeed_at_turn_reward_fn, GCONFIG, tokenizer, max_turns=3, turn_discount=0.5
    )
    out = await wf.arun_episode(rec, DATA)
    assert len(rec.calls) == 1 and out["rewards"].tolist() == [1.0]
    _check_trajectory(out, rec.calls, tokenizer)


async def test_version_change_between_turns_kept_per_token(engine, tokenizer):
    engine.set_version(3)
    try:
        rec = RecordingEngine(engine, bump_version_after_first=4)
        wf = MultiTurnWorkflow(never_reward_fn, GCONFIG, tokenizer, max_turns=2, turn_discount=1.0)
        out = await wf.arun_episode(rec, DATA)
    finally:
        engine.set_version(0)
    (_, r1), (_, r2) = rec.calls
    assert set(r1.output_versions) == {3} and set(r2.output_versions) == {4}
    ver, lm = out["versions"][0], out["loss_mask"][0].bool()
    assert set(ver[lm].tolist()) == {3, 4} and (ver[~lm] == -1).all()
    _check_trajectory(out, rec.calls, tokenizer)


def test_feedback_ids_follow_eos_as_the_chat_template_renders(tokenizer):
    fb = feedback_prompt_ids(tokenizer)
    answer = [{"role": "assistant", "content": "x"}]
    full = tokenizer.apply_chat_template(
        answer + [{"role": "user", "content": FEEDBACK}], tokenize=True, add_generation_prompt=True
    )
    if hasattr(full, "keys"):
        full = full["input_ids"]
    assert list(full[-len(fb) :]) == fb
    assert tokenizer.decode(fb).endswith("<|im_start|>assistant\n")
    assert FEEDBACK in tokenizer.decode(fb)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_turns=0, turn_discount=0.9), "max_turns"),
        (dict(max_turns=2, turn_discount=0.0), "turn_discount"),
    ],
)
def test_bad_arguments_raise_naming_the_field(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiTurnWorkflow(never_reward_fn, GCONFIG, tokenizer, **kwargs)
