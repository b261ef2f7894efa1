"""Token-in/token-out of the agent stack with a real model's chat template.

The guarantees of the tiny-model tests (``tests/test_areal_openai.py``,
``tests/test_openai_proxy.py``; helpers in ``tests/_agent_tokens.py``), here with
SmolLM2-135M-Instruct (``tests/_real_model.py``) served by a real built-in server. Its
chat template injects a default system prompt ("You are a helpful AI assistant named
SmolLM, trained by Hugging Face") when a conversation has none, and closes every message
with its EOS ``<|im_end|>`` and a newline. Three turns, no system message given, a user
message after each reply, through ``ArealOpenAI`` and through an OpenAI SDK agent on the
proxy; the export is what the model saw and produced:

- each prompt is the template of the conversation so far, with the injected system prompt
  once, at the start: its tokens exactly in ``hf`` mode; in ``concat`` mode its text
  exactly and its tokens exactly but for the earlier replies, which are the tokens the
  model generated (the template's own when they re-tokenise the same);
- the ``concat`` row is the engine's tokens; its loss mask covers exactly the generated
  tokens (nothing of the system prompt, user turns or template), each right after the
  template's ``<|im_start|>assistant\\n``;
- its logprobs are the server's, bit-exact, and the model's log-probabilities of those
  tokens in that context (a transformers forward pass over the whole row).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from _agent_tokens import (
    RecordingEngine,
    assert_concat_row_is_the_calls,
    chat_turns,
    proxy_session_turns,
    template_ids,
)
from _local_engine import local_engine
from _real_model import real_model_fixture  # noqa: F401 - the module fixture `real_model`

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# greedy, the model closes its first and third replies itself ("3 + 4 = 7<|im_end|>") and
# is cut at NEW_TOKENS in the second: both ways a reply joins the next prompt
QUESTION = [{"role": "user", "content": "What is 3 + 4? Reply with only the number."}]
FOLLOW_UPS = ("Are you sure?", "Now add 2 more.")
NEW_TOKENS = 10
SYSTEM_TEXT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
ADMIN = "real-template-admin-key"
# the server's logprobs (KV-cached decoding) against one full forward pass, both float32
# (measured: at most 2.5e-5 apart; a token scored in the wrong context is off by far more)
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def server(real_model):
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        real_model.apply_env(mp)  # the server process: offline, the shared cache
        with local_engine(real_model.snapshot, setup_timeout=240) as eng:
            yield eng


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from areal.utils.hf_utils import load_hf_tokenizer

    return load_hf_tokenizer(real_model.snapshot)


@pytest.fixture(scope="module")
def hf_model(real_model):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(real_model.snapshot, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def proxy(server, tokenizer):
    from areal.experimental.openai import ArealOpenAI
    from areal.experimental.openai.proxy import ProxyServer

    rec = RecordingEngine(server)
    client = ArealOpenAI(rec, tokenizer, chat_template_type="concat", engine_max_tokens=512)
    with ProxyServer(client, admin_api_key=ADMIN) as srv:
        yield srv, rec


@pytest.fixture(scope="module")
def system_ids(tokenizer) -> list[int]:
    """The tokens of the system block the template injects."""
    block = f"<|im_start|>system\n{SYSTEM_TEXT}<|im_end|>\n"
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.startswith(block), text
    ids = tokenizer.encode(block, add_special_tokens=False)
    assert template_ids(tokenizer, QUESTION)[: len(ids)] == ids
    return ids


def _plain(messages: list) -> list[dict]:
    """The agent's messages as dicts (replies may be SDK objects)."""
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in messages]


def _count(seq: list[int], sub: list[int]) -> int:
    return sum(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _decode(tokenizer, ids: list[int], skip_special: bool = False) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
    )


def _body(tokenizer, resp) -> list[int]:
    """A reply's generated tokens without its closing EOS."""
    out = list(resp.output_tokens)
    return out[:-1] if out[-1:] == [tokenizer.eos_token_id] else out


def _model_logprobs(hf_model, ids: list[int], temperature: float) -> torch.Tensor:
    """``[L]``: log p(ids[i] | ids[:i]) at temperature ``temperature`` (0.0 at 0)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def _assert_prompts_are_the_template(tokenizer, system_ids, calls, messages, concat: bool):
    """Prompt ``k`` is the chat template of ``messages[: 2k + 1]``, the system prompt once.

    ``hf`` mode renders every prompt: its tokens are the template's. ``concat`` mode keeps
    each earlier reply's generated tokens: with the re-tokenised text of each reply put
    back in their place (the same tokens unless the model generated a non-canonical
    tokenisation) they are the template's tokens, and they decode to its text.
    """
    msgs = _plain(messages)
    assert len(msgs) == 2 * len(calls)  # user, reply, ..., user, reply
    for k, (req, _) in enumerate(calls):
        prompt = list(req.input_ids)
        seen = msgs[: 2 * k + 1]
        assert [m["role"] for m in seen] == ["user", "assistant"] * k + ["user"]
        # the injected system prompt: once, at the start (none was given)
        assert prompt[: len(system_ids)] == system_ids
        assert _count(prompt, system_ids) == 1
        text = _decode(tokenizer, prompt)
        assert text.count(SYSTEM_TEXT) == 1 and text.count("<|im_start|>system") == 1
        # the replies as the agent got them: the generated tokens' text
        raw = [dict(m) for m in seen]
        for j in range(k):
            body = _body(tokenizer, calls[j][1])
            assert seen[2 * j + 1]["content"] == _decode(tokenizer, body, skip_special=True)
            raw[2 * j + 1]["content"] = _decode(tokenizer, body)  # = it, unless a special token
        want = template_ids(tokenizer, seen)
        if not concat:
            assert prompt == want, k
            continue
        # the text the model saw is the template's rendering of the conversation
        assert text == tokenizer.apply_chat_template(
            raw, tokenize=False, add_generation_prompt=True
        )
        spliced = list(prompt)
        for j in reversed(range(k)):
            start, body = len(calls[j][0].input_ids), _body(tokenizer, calls[j][1])
            assert spliced[start : start + len(body)] == body  # the reply's own tokens
            spliced[start : start + len(body)] = tokenizer.encode(
                seen[2 * j + 1]["content"], add_special_tokens=False
            )
        assert spliced == want, k


def _assert_concat_row(tokenizer, system_ids, hf_model, row, calls, temperature):
    """The ``concat`` row of one conversation (see the module docstring)."""
    eos = tokenizer.eos_token_id
    ids = assert_concat_row_is_the_calls(row, calls, eos)
    mask = row["loss_mask"][0].bool()
    # the system prompt once, at the start, out of the loss
    assert ids[: len(system_ids)] == system_ids and _count(ids, system_ids) == 1
    assert not mask[: len(system_ids)].any()
    # each reply follows the template's generation prompt; a truncated one was closed with
    # an EOS it did not generate (masked out)
    gen_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert template_ids(tokenizer, QUESTION)[-len(gen_prompt) :] == gen_prompt
    for k, (req, resp) in enumerate(calls):
        start, n = len(req.input_ids), len(resp.output_tokens)
        assert ids[start - len(gen_prompt) : start] == gen_prompt
        assert not mask[start - len(gen_prompt) : start].any() and mask[start : start + n].all()
        if k + 1 < len(calls) and resp.output_tokens[-1] != eos:
            assert resp.stop_reason == "length" and ids[start + n] == eos
            assert not mask[start + n]
    assert int(mask.sum()) == sum(len(resp.output_tokens) for _, resp in calls)
    # logprobs: the server's (checked bit-exact above), finite and <= 0, and the model's
    lp = row["logprobs"][0]
    assert all(math.isfinite(x) and x <= 0.0 for x in lp[mask].tolist())
    want = _model_logprobs(hf_model, ids, temperature)
    torch.testing.assert_close(lp[mask], want[mask], rtol=0, atol=LOGPROB_ATOL)


async def test_areal_openai_concat_turns_with_injected_system_prompt_export_token_exact(
    server, tokenizer, hf_model, system_ids
):
    from areal.experimental.openai import ArealOpenAI

    rec = RecordingEngine(server)
    client = ArealOpenAI(rec, tokenizer, chat_template_type="concat")
    messages = list(QUESTION)  # no system message: the template injects its default
    completions = await chat_turns(
        client, messages, FOLLOW_UPS, max_completion_tokens=NEW_TOKENS, temperature=0
    )
    assert len(rec.calls) == 3
    # both kinds of reply end (the EOS the model generated; one appended after a cut)
    assert {resp.stop_reason for _, resp in rec.calls} == {"stop", "length"}
    its = [client.get_interaction(c.id) for c in completions]
    assert its[0].parent is None and its[1].parent is its[0] and its[2].parent is its[1]
    # the first prompt has no earlier reply: it is the template's tokens in concat mode too
    assert list(rec.calls[0][0].input_ids) == template_ids(tokenizer, QUESTION)
    _assert_prompts_are_the_template(tokenizer, system_ids, rec.calls, messages, concat=True)
    client.set_last_reward(1.0)
    exported = client.export_interactions(style="concat", reward_discount=1.0)
    assert list(exported) == [completions[-1].id]  # one linear conversation -> one row
    row = exported[completions[-1].id].to_tensor_dict()
    _assert_concat_row(tokenizer, system_ids, hf_model, row, rec.calls, temperature=1.0)
    assert row["rewards"].tolist() == [1.0]


async def test_areal_openai_hf_mode_each_prompt_is_the_template_individual_rows_exact(
    server, tokenizer, system_ids
):
    from areal.experimental.openai import ArealOpenAI

    rec = RecordingEngine(server)
    client = ArealOpenAI(rec, tokenizer)  # "hf": every call renders its whole conversation
    messages = list(QUESTION)
    completions = await chat_turns(
        client, messages, FOLLOW_UPS, max_completion_tokens=NEW_TOKENS, temperature=0
    )
    _assert_prompts_are_the_template(tokenizer, system_ids, rec.calls, messages, concat=False)
    exported = client.export_interactions(style="individual")
    assert list(exported) == [c.id for c in completions]
    for (req, resp), it in zip(rec.calls, exported.values()):
        row = it.to_tensor_dict()
        n_in, n_out = len(req.input_ids), len(resp.output_tokens)
        assert row["input_ids"][0].tolist() == list(req.input_ids) + list(resp.output_tokens)
        assert row["loss_mask"][0].tolist() == [0] * n_in + [1] * n_out
        torch.testing.assert_close(
            row["logprobs"][0, n_in:],
            torch.tensor(resp.output_logprobs, dtype=torch.float32),
            rtol=0,
            atol=0,
        )


def test_proxy_agent_concat_turns_with_injected_system_prompt_export_token_exact(
    proxy, tokenizer, hf_model, system_ids
):
    srv, rec = proxy
    messages = list(QUESTION)
    temperature = 0.7  # seeded sampling: the logprobs are those of the tempered distribution
    ids, exported, calls = asyncio.run(
        proxy_session_turns(
            srv,
            ADMIN,
            rec,
            messages,
            FOLLOW_UPS,
            1.0,
            "concat",
            model="m",
            max_tokens=NEW_TOKENS,
            temperature=temperature,
            seed=11,
        )
    )
    assert len(calls) == 3 and all(req.gconfig.temperature == temperature for req, _ in calls)
    assert list(calls[0][0].input_ids) == template_ids(tokenizer, QUESTION)
    _assert_prompts_are_the_template(tokenizer, system_ids, calls, messages, concat=True)
    assert list(exported) == [ids[-1]]  # one linear conversation -> one row
    row = exported[ids[-1]].to_tensor_dict()
    _assert_concat_row(tokenizer, system_ids, hf_model, row, calls, temperature)
    assert float(row["rewards"][0]) == 1.0
