"""ArealOpenAI against a REAL built-in inference server (random tiny model + tiny tokenizer).

The engine is wrapped by a recorder that forwards to the real server and keeps every
(request, response), so exports are compared with what the server actually returned.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from _agent_tokens import RecordingEngine, assert_concat_row_is_the_calls, chat_turns, template_ids
from _local_engine import local_engine

from areal.experimental.openai import ArealOpenAI, InteractionWithTokenLogpReward

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

import openai  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402
from openai.types.responses import Response  # noqa: E402

QUESTION = [{"role": "user", "content": "Mia has 3 apples. She buys 4 more. How many?"}]
FOLLOW_UPS = ["Are you sure?", "Please check again."]


@pytest.fixture(scope="module")
def engine(tiny_lm_dir):
    with local_engine(tiny_lm_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def tokenizer(tiny_lm_dir):
    from areal.utils.hf_utils import load_hf_tokenizer

    return load_hf_tokenizer(tiny_lm_dir)


async def _three_turns(client, **create_kwargs):
    return await chat_turns(
        client, list(QUESTION), FOLLOW_UPS, model="tiny", max_completion_tokens=6, **create_kwargs
    )


async def test_chat_completion_is_an_openai_object_served_by_the_engine(engine, tokenizer):
    rec = RecordingEngine(engine)
    client = ArealOpenAI(engine=rec, tokenizer=tokenizer)
    assert isinstance(client, openai.AsyncOpenAI)
    c = await client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=5, temperature=0, logprobs=True
    )
    assert isinstance(c, ChatCompletion) and c.object == "chat.completion" and c.model == "tiny"
    ((req, resp),) = rec.calls
    assert req.input_ids == template_ids(tokenizer, QUESTION)
    assert req.gconfig.greedy and req.gconfig.max_new_tokens == 5
    assert c.usage.prompt_tokens == len(req.input_ids)
    assert c.usage.completion_tokens == resp.output_len
    assert c.usage.total_tokens == len(req.input_ids) + resp.output_len
    assert c.choices[0].finish_reason == ("length" if resp.stop_reason == "length" else "stop")
    body = [t for t in resp.output_tokens if t != tokenizer.eos_token_id]
    assert c.choices[0].message.content == tokenizer.decode(body, skip_special_tokens=True)
    assert [x.logprob for x in c.choices[0].logprobs.content] == pytest.approx(resp.output_logprobs)
    # recorded with the engine's exact tokens
    it = client.get_interaction(c.id)
    assert it.model_response is resp and it.completion is c
    row = it.to_tensor_dict()
    assert row["input_ids"][0].tolist() == req.input_ids + resp.output_tokens
    assert row["loss_mask"][0].tolist() == [0] * len(req.input_ids) + [1] * resp.output_len
    # greedy is deterministic through the whole path
    c2 = await client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=5, temperature=0
    )
    assert rec.calls[1][1].output_tokens == resp.output_tokens
    assert c2.choices[0].message.content == c.choices[0].message.content


async def test_concat_three_turns_export_one_token_exact_sequence(engine, tokenizer):
    rec = RecordingEngine(engine)
    client = ArealOpenAI(engine=rec, tokenizer=tokenizer, chat_template_type="concat")
    completions = await _three_turns(client)
    assert len(rec.calls) == 3
    # parents resolved from the messages
    its = [client.get_interaction(c.id) for c in completions]
    assert its[0].parent is None and its[1].parent is its[0] and its[2].parent is its[1]

    client.set_last_reward(1.0)
    client.apply_reward_discount(turn_discount=0.9)
    exported = client.export_interactions(style="concat")
    assert list(exported) == [completions[2].id]  # one leaf for one linear conversation
    row = exported[completions[2].id].to_tensor_dict()
    # every turn's prompt extends the previous turn's exact tokens (+ EOS if truncated); the
    # row is the server's tokens, unchanged; the loss mask covers exactly the three
    # generated outputs, with their logprobs and versions
    assert_concat_row_is_the_calls(row, rec.calls, tokenizer.eos_token_id)
    assert row["rewards"].tolist() == [1.0]


async def test_individual_export_rows_are_the_engine_calls_with_discounted_rewards(
    engine, tokenizer
):
    rec = RecordingEngine(engine)
    client = ArealOpenAI(engine=rec, tokenizer=tokenizer)  # "hf": full re-render per call
    completions = await _three_turns(client)
    client.set_last_reward(1.0)
    client.apply_reward_discount(turn_discount=0.5)
    exported = client.export_interactions(style="individual")
    assert list(exported) == [c.id for c in completions]
    for (req, resp), it in zip(rec.calls, exported.values()):
        assert isinstance(it, InteractionWithTokenLogpReward)
        row = it.to_tensor_dict()
        assert row["input_ids"][0].tolist() == req.input_ids + resp.output_tokens
        assert row["loss_mask"][0].tolist() == [0] * len(req.input_ids) + [1] * resp.output_len
    assert [it.to_tensor_dict()["rewards"].item() for it in exported.values()] == [0.25, 0.5, 1.0]
    # each prompt is the template of the conversation so far
    assert rec.calls[2][0].input_ids == template_ids(
        tokenizer, exported[completions[2].id].messages
    )
    with pytest.raises(ValueError, match="concat"):
        client.export_interactions(style="concat")
    with pytest.raises(RuntimeError, match="once"):
        client.apply_reward_discount(0.5)


async def test_set_reward_by_id_and_branching_conversations(engine, tokenizer):
    client = ArealOpenAI(engine=engine, tokenizer=tokenizer, chat_template_type="concat")
    a = await client.chat.completions.create(messages=QUESTION, max_tokens=4)
    base = QUESTION + [a.choices[0].message]
    b = await client.chat.completions.create(
        messages=base + [{"role": "user", "content": "Branch one."}], max_tokens=4
    )
    c = await client.chat.completions.create(
        messages=base + [{"role": "user", "content": "Branch two."}], max_tokens=4
    )
    client.set_reward(b.id, 1.0)
    client.set_reward(c.id, -1.0)
    with pytest.raises(KeyError):
        client.set_reward("chatcmpl-unknown", 1.0)
    assert client.cache.total_reward == 0.0
    leaves = client.export_interactions(style="concat")
    assert set(leaves) == {b.id, c.id}
    assert client.get_interaction(b.id).parent is client.get_interaction(a.id)
    assert leaves[c.id].to_tensor_dict()["rewards"].tolist() == [-1.0]


async def test_stream_yields_chunks_and_records_the_call(engine, tokenizer):
    client = ArealOpenAI(engine=engine, tokenizer=tokenizer)
    stream = await client.chat.completions.create(
        messages=QUESTION, max_tokens=5, temperature=0, stream=True
    )
    chunks = [ch async for ch in stream]
    assert all(isinstance(ch, ChatCompletionChunk) for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    it = client.get_interaction(chunks[0].id)
    assert it is not None and text == it.completion.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == it.model_response.output_len


async def test_responses_create_returns_response_and_records_it(engine, tokenizer):
    rec = RecordingEngine(engine)
    client = ArealOpenAI(engine=rec, tokenizer=tokenizer)
    r = await client.responses.create(
        input="What is 3 plus 4?", instructions="Be brief.", max_output_tokens=5, temperature=0
    )
    assert isinstance(r, Response) and r.object == "response"
    ((req, resp),) = rec.calls
    expect = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 plus 4?"},
    ]
    assert req.input_ids == template_ids(tokenizer, expect)
    assert r.usage.input_tokens == len(req.input_ids) and r.usage.output_tokens == resp.output_len
    body = [t for t in resp.output_tokens if t != tokenizer.eos_token_id]
    assert r.output_text == tokenizer.decode(body, skip_special_tokens=True)
    it = client.get_interaction(r.id)
    assert it.is_response and it.to_tensor_dict()["input_ids"][0].tolist() == (
        req.input_ids + resp.output_tokens
    )
    # feeding the output back links the next response to this one
    r2 = await client.responses.create(
        input=[{"role": "user", "content": "What is 3 plus 4?"}]
        + [o.model_dump() for o in r.output]
        + [{"role": "user", "content": "Sure?"}],
        instructions="Be brief.",
        max_output_tokens=3,
    )
    assert client.get_interaction(r2.id).parent is it


async def test_bad_requests_raise_and_leave_no_record(engine, tokenizer):
    client = ArealOpenAI(engine=engine, tokenizer=tokenizer, engine_max_tokens=20)
    with pytest.raises(ValueError, match="n=2"):
        await client.chat.completions.create(messages=QUESTION, n=2)
    with pytest.raises(ValueError, match="no room"):  # the prompt alone exceeds 20 tokens
        await client.chat.completions.create(messages=QUESTION, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        await client.chat.completions.create(messages=[])
    with pytest.raises(TypeError):
        await client.chat.completions.create(messages="hello")
    assert len(client.cache) == 0
    with pytest.raises(RuntimeError, match="no interaction"):
        client.set_last_reward(1.0)
    with pytest.raises(ValueError, match="chat_template_type"):
        ArealOpenAI(engine=engine, tokenizer=tokenizer, chat_template_type="jinja")


async def test_store_false_is_not_recorded_and_exports_pickle(engine, tokenizer):
    client = ArealOpenAI(engine=engine, tokenizer=tokenizer)
    await client.chat.completions.create(messages=QUESTION, max_tokens=3, store=False)
    assert len(client.cache) == 0
    c = await client.chat.completions.create(messages=QUESTION, max_tokens=3)
    client.set_last_reward(0.5)
    exported = client.export_interactions(style="individual")
    back = pickle.loads(pickle.dumps(exported))
    torch.testing.assert_close(back[c.id].to_tensor_dict(), exported[c.id].to_tensor_dict())
    # an empty cache deep-copies to a new, independent one (a config holding a fresh
    # client is copyable); a cache holding an episode refuses (its lock, its interactions)
    empty = type(client.cache)()
    dup = copy.deepcopy(empty)
    assert type(dup) is type(empty) and dup is not empty and len(dup) == 0
    with pytest.raises(TypeError, match="only an empty"):
        copy.deepcopy(client.cache)
    back_cache = pickle.loads(pickle.dumps(client.cache))
    assert list(back_cache) == list(client.cache) == [c.id]
