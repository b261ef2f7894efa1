"""Helpers of the agent stack's token-in/token-out tests (``ArealOpenAI`` and the proxy).

Shared by ``tests/test_areal_openai.py`` and ``tests/test_openai_proxy.py`` (the tiny
model) and ``tests/test_real_template_tokens.py`` (SmolLM2-135M-Instruct's chat template):

- :class:`RecordingEngine` keeps every (request, response) the real server answered, so
  exports can be compared with the tokens the model actually saw and produced;
- :func:`chat_turns` (an ``ArealOpenAI`` client) and :func:`proxy_session_turns` (the
  OpenAI SDK against the proxy, one RL session) play one linear conversation, a user
  message appended after each assistant reply;
- :func:`assert_concat_row_is_the_calls`: a ``concat`` export row is exactly the engine
  calls' tokens, its loss mask exactly their outputs, with their logprobs and versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class RecordingEngine:
    """Forwards to a connected engine and records each ``(ModelRequest, ModelResponse)``."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    def get_version(self):
        return self.engine.get_version()

    async def agenerate(self, req):
        resp = await self.engine.agenerate(req)
        self.calls.append((req, resp))
        return resp


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's token ids of ``messages`` with the generation prompt."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def chat_turns(
    client, messages: list[dict], follow_ups: Sequence[str], **create_kwargs: Any
) -> list[Any]:
    """``len(follow_ups) + 1`` chat completions of one conversation through ``client``
    (``ArealOpenAI``); each reply is appended as the SDK object (as agents do), then the
    next user message. ``messages`` is extended in place; returns the completions."""
    completions = []
    for k in range(len(follow_ups) + 1):
        c = await client.chat.completions.create(messages=messages, **create_kwargs)
        completions.append(c)
        messages.append(c.choices[0].message)
        if k < len(follow_ups):
            messages.append({"role": "user", "content": follow_ups[k]})
    return completions


async def proxy_session_turns(
    proxy,
    admin_key: str,
    engine: RecordingEngine,
    messages: list[dict],
    follow_ups: Sequence[str],
    discount: float,
    style: str,
    reward_last: float = 1.0,
    **create_kwargs: Any,
) -> tuple[list[str], dict, list]:
    """One RL session on ``proxy`` (a ``ProxyServer`` whose client generates on
    ``engine``): an agent program on the OpenAI SDK plays ``len(follow_ups) + 1`` turns
    (replies appended as JSON dicts, as they come over HTTP; ``messages`` extended in
    place), rewards the last one, ends the session and exports it.

    Returns (completion ids, the export ``{id: interaction}``, the session's engine calls).
    """
    import httpx2 as httpx
    import openai

    from areal.experimental.openai.proxy import OpenAIProxyClient

    http = httpx.AsyncClient(timeout=120)
    try:
        sess = OpenAIProxyClient(http, proxy.base_url, "t", admin_key)
        await sess.start()
        client = openai.AsyncOpenAI(
            base_url=proxy.base_url, api_key=sess.session_api_key, http_client=http
        )
        n0 = len(engine.calls)
        ids = []
        for k in range(len(follow_ups) + 1):
            out = await client.chat.completions.create(messages=messages, **create_kwargs)
            ids.append(out.id)
            messages.append(out.choices[0].message.model_dump(exclude_none=True))
            if k < len(follow_ups):
                messages.append({"role": "user", "content": follow_ups[k]})
        await sess.set_last_reward(reward_last)
        await sess.end()
        exported = await sess.export_interactions(discount=discount, style=style)
        return ids, exported, engine.calls[n0:]
    finally:
        await http.aclose()


def assert_concat_row_is_the_calls(row: dict, calls: list, eos_token_id: int) -> list[int]:
    """``row`` (the ``concat`` export of one linear conversation) is the engine's tokens.

    Every turn's prompt extends the previous turn's exact input + output (+ the EOS a
    truncated output lacked); the row is the last prompt + the last output, unchanged;
    the loss mask is 1 exactly on the generated outputs, where ``logprobs`` and
    ``versions`` are the server's values (bit-exact), 0.0 / -1 elsewhere. Returns the
    row's ids.
    """
    for (req_a, resp_a), (req_b, _) in zip(calls, calls[1:]):
        head = list(req_a.input_ids) + list(resp_a.output_tokens)
        if head[-1] != eos_token_id:
            head.append(eos_token_id)
        assert list(req_b.input_ids[: len(head)]) == head and len(req_b.input_ids) > len(head)
    ids = row["input_ids"][0].tolist()
    last_req, last_resp = calls[-1]
    assert ids == list(last_req.input_ids) + list(last_resp.output_tokens)
    assert row["input_ids"].shape == row["loss_mask"].shape == row["logprobs"].shape
    assert row["versions"].shape == row["input_ids"].shape
    expect_mask = [0] * len(ids)
    expect_lp = [0.0] * len(ids)
    expect_ver = [-1] * len(ids)
    for req, resp in calls:
        start, n = len(req.input_ids), len(resp.output_tokens)
        assert ids[start : start + n] == list(resp.output_tokens)
        expect_mask[start : start + n] = [1] * n
        expect_lp[start : start + n] = list(resp.output_logprobs)
        expect_ver[start : start + n] = list(resp.output_versions)
    assert row["loss_mask"][0].tolist() == expect_mask
    torch.testing.assert_close(
        row["logprobs"][0], torch.tensor(expect_lp, dtype=torch.float32), rtol=0, atol=0
    )
    assert row["versions"][0].tolist() == expect_ver
    assert row["attention_mask"].dtype == torch.bool and bool(row["attention_mask"].all())
    return ids
