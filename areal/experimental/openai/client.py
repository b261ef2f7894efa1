"""``ArealOpenAI``: the official ``openai.AsyncOpenAI`` client, served by an inference engine.

``client.chat.completions.create(...)`` and ``client.responses.create(...)`` take the
usual OpenAI arguments and return the usual OpenAI objects (``ChatCompletion`` with
``tool_calls`` and ``usage``, or a stream of ``ChatCompletionChunk``; ``Response``), but
no HTTP request to OpenAI is made: the messages are turned into token ids with the
tokenizer's chat template, ``engine.agenerate(ModelRequest)`` generates, the output is
decoded and parsed (``<tool_call>`` JSON, ``<think>`` reasoning), and every call is
recorded in the client's :class:`~areal.experimental.openai.cache.InteractionCache` with
the engine's exact token ids, logprobs and weight versions. Rewards are attached with
:meth:`ArealOpenAI.set_reward` / :meth:`ArealOpenAI.set_last_reward`, propagated with
:meth:`ArealOpenAI.apply_reward_discount`, and :meth:`ArealOpenAI.export_interactions`
returns ``{id: InteractionWithTokenLogpReward}``, which ``arun_episode`` may return as is.

Prompt construction (``chat_template_type``, AReaL's values):

- ``"hf"``: every call renders its whole ``messages`` (and ``tools``) with the chat
  template. Each interaction is a correct (prompt, output) pair; export ``individual``.
- ``"concat"``: a call whose messages extend an earlier interaction's messages + output
  (its parent in the cache) reuses the parent's exact token ids (input + output, plus an
  EOS if the output had none) and appends only the tokens of the new messages, as the
  chat template renders them after the parent's last EOS. Multi-turn conversations then
  become one token sequence with no re-tokenisation drift; export ``concat``.

Generation arguments: ``temperature`` (0 = greedy; default 1.0), ``top_p``,
``max_completion_tokens`` / ``max_tokens`` (new tokens), ``max_total_tokens`` (prompt +
new, also capped by ``engine_max_tokens``; default 512 new tokens when nothing is set),
``stop``, ``frequency_penalty``, ``seed``, ``metadata``, ``tools`` / ``tool_choice``
(``"none"`` disables parsing), ``logprobs``, ``store=False`` (do not record), ``stream``,
``extra_body={"chat_template_kwargs": {...}}``. ``n`` must be 1. Other OpenAI arguments are
accepted and ignored (logged once).
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import AsyncGenerator, Iterable, Mapping
from copy import deepcopy
from typing import Any, Protocol

from openai import AsyncOpenAI
from openai.resources.chat.completions.completions import AsyncCompletions
from openai.resources.responses.responses import AsyncResponses
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.completion_usage import CompletionUsage
from openai.types.responses import Response, ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_usage import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseUsage,
)
from pydantic import BaseModel

from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import ModelRequest, ModelResponse
from areal.experimental.openai.cache import InteractionCache
from areal.experimental.openai.tool_call_parser import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    parse_reasoning,
    process_tool_calls,
)
from areal.experimental.openai.types import InteractionWithTokenLogpReward
from areal.utils import logging

logger = logging.getLogger("ArealOpenAI")

CHAT_TEMPLATE_TYPES = ("hf", "concat")
DEFAULT_MAX_NEW_TOKENS = 512
_warned: set[str] = set()


class AsyncGenerateEngine(Protocol):
    """What the client needs from an engine (any ``InferenceEngine`` has it)."""

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...


def is_omitted(value: Any) -> bool:
    """True for ``None`` and the SDK's ``NOT_GIVEN`` / ``omit`` sentinels."""
    return value is None or type(value).__name__ in ("NotGiven", "Omit")


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _normalize(item: Any) -> Any:
    if isinstance(item, BaseModel):
        return _normalize(item.model_dump(exclude_none=True))
    if isinstance(item, Mapping):
        return {k: _normalize(v) for k, v in item.items() if v is not None}
    if isinstance(item, list | tuple):
        return [_normalize(x) for x in item]
    return item


def normalize_messages(name: str, value: Any) -> list[dict[str, Any]]:
    """Messages (dicts or SDK objects) as plain dicts without ``None`` values."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping | BaseModel):
            raise TypeError(f"{name}[{i}] must be a dict or an SDK message, got {type(m).__name__}")
        out.append(_normalize(m))
    return out


def _template_ids(
    tokenizer: Any, messages: list[dict], tools: list | None, template_kwargs: dict
) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True, **template_kwargs
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


def _find_kth(tokens: list[int], target: int, k: int) -> int:
    seen = 0
    for i, t in enumerate(tokens):
        if t == target:
            seen += 1
            if seen == k:
                return i
    return -1


def parent_tokens(parent: InteractionWithTokenLogpReward, eos_token_id: int) -> list[int]:
    """The parent's exact input + output ids, ending with an EOS (appended if missing)."""
    tokens = parent.full_tokens()
    if tokens[-1:] != [eos_token_id]:
        tokens.append(eos_token_id)
    return tokens


def concat_prompt_token_ids_with_parent(
    messages: list[dict],
    parent: InteractionWithTokenLogpReward | None,
    tokenizer: Any,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Prompt ids for ``chat_template_type="concat"`` (see the module docstring).

    The full conversation is rendered with the template; with ``k`` EOS tokens in the
    parent's tokens, everything after the ``k``-th EOS of the rendering is the new part.
    """
    rendered = _template_ids(tokenizer, messages, tools, template_kwargs or {})
    if parent is None:
        return rendered
    eos = tokenizer.eos_token_id
    head = parent_tokens(parent, eos)
    cut = _find_kth(rendered, eos, head.count(eos))
    if cut == -1 or cut + 1 >= len(rendered):
        raise RuntimeError(
            f"concat mode: cannot align the new messages with the parent interaction "
            f"{parent.interaction_id} ({head.count(eos)} EOS in the parent's tokens, "
            f"{rendered.count(eos)} in the rendered conversation)"
        )
    return head + rendered[cut + 1 :]


def _stop_ids(tokenizer: Any) -> list[int]:
    ids = {tokenizer.eos_token_id}
    if tokenizer.pad_token_id is not None:
        ids.add(tokenizer.pad_token_id)
    return sorted(i for i in ids if i is not None)


def _finish_reason(stop_reason: str) -> str:
    return "length" if stop_reason == "length" else "stop"


class _EngineCall:
    """The shared path of both APIs: prompt ids -> engine -> decoded text -> cache."""

    def __init__(
        self,
        engine: AsyncGenerateEngine,
        tokenizer: Any,
        cache: InteractionCache,
        tool_call_parser: str,
        reasoning_parser: str,
        engine_max_tokens: int | None,
        chat_template_type: str,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self._cache = cache
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.engine_max_tokens = engine_max_tokens
        self.chat_template_type = chat_template_type

    def prompt_ids(
        self,
        interaction: InteractionWithTokenLogpReward | None,
        messages: list[dict],
        tools: list | None,
        template_kwargs: dict,
    ) -> list[int]:
        if self.chat_template_type == "concat":
            parent = interaction.parent if interaction is not None else None
            return concat_prompt_token_ids_with_parent(
                messages, parent, self.tokenizer, tools, template_kwargs
            )
        return _template_ids(self.tokenizer, messages, tools, template_kwargs)

    def gconfig(
        self,
        n_prompt: int,
        temperature: Any,
        top_p: Any,
        max_new: Any,
        max_total: Any,
        stop: Any,
        frequency_penalty: Any,
    ) -> GenerationHyperparameters:
        total = None if is_omitted(max_total) else int(max_total)
        if self.engine_max_tokens is not None:
            total = self.engine_max_tokens if total is None else min(total, self.engine_max_tokens)
        new = None if is_omitted(max_new) else int(max_new)
        if total is not None:
            room = total - n_prompt
            if room <= 0:
                raise ValueError(
                    f"the prompt has {n_prompt} tokens: no room under max_total_tokens={total}"
                )
            new = room if new is None else min(new, room)
        if new is None:
            _warn_once(
                "max_new",
                "no max_tokens given; generating at most %d tokens",
                DEFAULT_MAX_NEW_TOKENS,
            )
            new = DEFAULT_MAX_NEW_TOKENS
        if new < 1:
            raise ValueError(f"max_tokens={new}; must be >= 1")
        temp = 1.0 if is_omitted(temperature) else float(temperature)
        if temp < 0:
            raise ValueError(f"temperature={temp}; must be >= 0")
        stops = None if is_omitted(stop) else ([stop] if isinstance(stop, str) else list(stop))
        if stops and self.chat_template_type == "concat":
            _warn_once(
                "stop", "stop strings are ignored in concat mode (they break token alignment)"
            )
            stops = None
        return GenerationHyperparameters(
            n_samples=1,
            max_new_tokens=new,
            max_tokens=total if total is not None else n_prompt + new,
            greedy=temp == 0.0,
            temperature=temp if temp > 0 else 1.0,
            top_p=1.0 if is_omitted(top_p) else float(top_p) or 1.0,
            stop=stops,
            stop_token_ids=_stop_ids(self.tokenizer),
            frequency_penalty=0.0 if is_omitted(frequency_penalty) else float(frequency_penalty),
        )

    async def generate(
        self, prompt: list[int], gconfig: GenerationHyperparameters, metadata: Any, seed: Any
    ) -> tuple[ModelResponse, str]:
        meta = {} if is_omitted(metadata) else dict(metadata)
        if not is_omitted(seed):
            meta["seed"] = int(seed)
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(prompt),
            gconfig=gconfig,
            tokenizer=self.tokenizer,
            metadata=meta,
        )
        resp = await self.engine.agenerate(req)
        out = list(resp.output_tokens)
        if resp.stop_reason == "stop" and out and out[-1] in set(gconfig.stop_token_ids):
            out = out[:-1]
        return resp, self.tokenizer.decode(out, skip_special_tokens=True)

    def start(
        self, key: str, areal_cache: InteractionCache | None, **fields: Any
    ) -> tuple[InteractionCache, InteractionWithTokenLogpReward]:
        cache = areal_cache if areal_cache is not None else self._cache
        if key in cache:
            raise ValueError(f"interaction {key} already exists in the cache")
        interaction = InteractionWithTokenLogpReward(
            chat_template_type=self.chat_template_type, **fields
        )
        cache[key] = interaction
        return cache, interaction


def _unsupported(kwargs: dict[str, Any]) -> None:
    for k, v in kwargs.items():
        if k in ("extra_headers", "extra_query", "timeout", "model"):
            continue
        if not is_omitted(v):
            _warn_once(f"arg:{k}", "argument %r is not supported by ArealOpenAI; ignored", k)


class AsyncCompletionsWithReward(AsyncCompletions):
    """``chat.completions`` served by the engine and recorded in the cache."""

    def __init__(self, client: AsyncOpenAI, call: _EngineCall):
        super().__init__(client)
        self._call = call

    def _build(
        self,
        completion_id: str,
        created: int,
        model: str,
        text: str,
        tool_calls: list | None,
        finish_reason: str,
        resp: ModelResponse,
        want_logprobs: bool,
    ) -> ChatCompletion:
        extra: dict[str, Any] = {}
        if self._call.reasoning_parser:
            reasoning, _ = parse_reasoning(text, self._call.reasoning_parser)
            if reasoning is not None:
                extra["reasoning_content"] = reasoning
        message = ChatCompletionMessage(
            role="assistant",
            content=(text or None) if tool_calls else text,
            tool_calls=tool_calls or None,
            **extra,
        )
        logprobs = None
        if want_logprobs:
            toks = self._call.tokenizer.convert_ids_to_tokens(list(resp.output_tokens))
            logprobs = ChoiceLogprobs(
                content=[
                    ChatCompletionTokenLogprob(
                        token=str(t), logprob=float(lp), bytes=None, top_logprobs=[]
                    )
                    for t, lp in zip(toks, resp.output_logprobs)
                ]
            )
        return ChatCompletion(
            id=completion_id,
            object="chat.completion",
            created=created,
            model=model,
            choices=[
                Choice(index=0, finish_reason=finish_reason, message=message, logprobs=logprobs)
            ],
            usage=CompletionUsage(
                prompt_tokens=resp.input_len,
                completion_tokens=resp.output_len,
                total_tokens=resp.input_len + resp.output_len,
            ),
        )

    async def create(  # type: ignore[override]
        self,
        *,
        messages: Iterable[Any],
        model: str | None = None,
        frequency_penalty: Any = None,
        logprobs: Any = None,
        max_completion_tokens: Any = None,
        max_tokens: Any = None,
        max_total_tokens: Any = None,
        metadata: Any = None,
        n: Any = None,
        seed: Any = None,
        stop: Any = None,
        store: Any = None,
        stream: Any = None,
        temperature: Any = None,
        tool_choice: Any = None,
        tools: Any = None,
        top_p: Any = None,
        extra_body: dict | None = None,
        areal_cache: InteractionCache | None = None,
        **kwargs: Any,
    ) -> ChatCompletion | AsyncGenerator[ChatCompletionChunk, None]:
        """OpenAI ``chat.completions.create`` on the engine (see the module docstring)."""
        _unsupported(kwargs)
        if not is_omitted(n) and n != 1:
            raise ValueError(f"n={n}: only n=1 is supported (call create n times)")
        if not is_omitted(max_tokens) and not is_omitted(max_completion_tokens):
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        msgs = normalize_messages("messages", messages)
        if not msgs:
            raise ValueError("messages must not be empty")
        tools_list = None if is_omitted(tools) else normalize_messages("tools", tools)
        template_kwargs = dict((extra_body or {}).get("chat_template_kwargs", {}))
        call = self._call
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:29]}"
        record = is_omitted(store) or bool(store)
        cache, interaction = None, None
        if record:
            cache, interaction = call.start(completion_id, areal_cache, messages=deepcopy(msgs))
        try:
            prompt = call.prompt_ids(interaction, msgs, tools_list, template_kwargs)
            gconfig = call.gconfig(
                len(prompt),
                temperature,
                top_p,
                max_completion_tokens if is_omitted(max_tokens) else max_tokens,
                max_total_tokens,
                stop,
                frequency_penalty,
            )
            resp, text = await call.generate(prompt, gconfig, metadata, seed)
        except BaseException:
            if cache is not None:
                cache.pop(completion_id, None)
            raise
        finish = _finish_reason(resp.stop_reason)
        tool_calls = None
        if tools_list and tool_choice != "none":
            tool_calls, text, finish = process_tool_calls(
                text, tools_list, call.tool_call_parser, call.reasoning_parser, finish
            )
        completion = self._build(
            completion_id,
            int(datetime.datetime.now().timestamp()),
            "areal" if is_omitted(model) else str(model),
            text,
            tool_calls,
            finish,
            resp,
            bool(logprobs),
        )
        if interaction is not None:
            interaction.completion = completion
            interaction.model_response = resp
            interaction.output_message_list = [
                completion.choices[0].message.model_dump(exclude_none=True)
            ]
        if stream is True:
            return _stream(completion)
        return completion


async def _stream(completion: ChatCompletion) -> AsyncGenerator[ChatCompletionChunk, None]:
    """The finished completion as chunks: role, content, tool calls, finish + usage."""
    msg = completion.choices[0].message

    def chunk(delta: ChoiceDelta, finish: Any = None, usage: Any = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=completion.id,
            object="chat.completion.chunk",
            created=completion.created,
            model=completion.model,
            choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)],
            usage=usage,
        )

    yield chunk(ChoiceDelta(role="assistant", content=""))
    if msg.content:
        yield chunk(ChoiceDelta(content=msg.content))
    for i, tc in enumerate(msg.tool_calls or []):
        yield chunk(
            ChoiceDelta(
                tool_calls=[
                    ChoiceDeltaToolCall(
                        index=i,
                        id=tc.id,
                        type="function",
                        function=ChoiceDeltaToolCallFunction(
                            name=tc.function.name, arguments=tc.function.arguments
                        ),
                    )
                ]
            )
        )
    yield chunk(ChoiceDelta(), completion.choices[0].finish_reason, completion.usage)


# ----------------------------------------------------------------------------- Responses API
def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content or []:
        if not isinstance(p, Mapping):
            raise ValueError(f"unsupported content part {p!r}")
        if p.get("type") in ("input_text", "output_text", "text"):
            parts.append(p.get("text", ""))
        else:
            raise ValueError(f"unsupported content part type {p.get('type')!r}")
    return "".join(parts)


def response_items_to_messages(items: list[dict]) -> list[dict]:
    """Responses-API input/output items -> Chat Completions messages.

    Messages keep their role and text; consecutive ``function_call`` items become one
    assistant message with ``tool_calls``; ``function_call_output`` becomes a ``tool``
    message. Reasoning items are dropped.
    """
    out: list[dict] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" or ("role" in item and "type" not in item):
            out.append({"role": item["role"], "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")},
            }
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "content": str(item.get("output", "")),
                    "tool_call_id": item.get("call_id"),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise ValueError(f"unsupported Responses input item type {kind!r}")
    return out


def _chat_tools(tools: list[dict]) -> list[dict]:
    """Responses function tools (flat) -> Chat Completions tools (nested ``function``)."""
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise ValueError(f"only function tools are supported, got {t.get('type')!r}")
        if "function" in t:
            out.append(t)
        else:
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            out.append({"type": "function", "function": fn})
    return out


class AsyncResponsesWithReward(AsyncResponses):
    """``responses`` served by the engine and recorded in the cache."""

    def __init__(self, client: AsyncOpenAI, call: _EngineCall):
        super().__init__(client)
        self._call = call

    async def create(  # type: ignore[override]
        self,
        *,
        input: Any = None,  # noqa: A002 - the SDK's name
        instructions: Any = None,
        max_output_tokens: Any = None,
        metadata: Any = None,
        model: Any = None,
        temperature: Any = None,
        tool_choice: Any = None,
        tools: Any = None,
        top_p: Any = None,
        frequency_penalty: Any = None,
        seed: Any = None,
        stop: Any = None,
        extra_body: dict | None = None,
        areal_cache: InteractionCache | None = None,
        **kwargs: Any,
    ) -> Response:
        """OpenAI ``responses.create`` on the engine (text and function-call output)."""
        _unsupported(kwargs)
        if is_omitted(input):
            raise ValueError("input is required")
        items = [{"role": "user", "content": input}] if isinstance(input, str) else None
        if items is None:
            items = normalize_messages("input", input)
        msgs = [] if is_omitted(instructions) else [{"role": "system", "content": instructions}]
        msgs += response_items_to_messages(items)
        flat_tools = [] if is_omitted(tools) else normalize_messages("tools", tools)
        tools_list = _chat_tools(flat_tools) or None
        template_kwargs = dict((extra_body or {}).get("chat_template_kwargs", {}))
        call = self._call
        resp_id = f"resp_{uuid.uuid4().hex[:29]}"
        cache, interaction = call.start(
            resp_id, areal_cache, messages=deepcopy(msgs), input_data=deepcopy(input)
        )
        try:
            prompt = call.prompt_ids(interaction, msgs, tools_list, template_kwargs)
            gconfig = call.gconfig(
                len(prompt), temperature, top_p, max_output_tokens, None, stop, frequency_penalty
            )
            engine_resp, text = await call.generate(prompt, gconfig, metadata, seed)
        except BaseException:
            cache.pop(resp_id, None)
            raise
        tool_calls = None
        if tools_list and tool_choice != "none":
            tool_calls, text, _ = process_tool_calls(
                text, flat_tools, call.tool_call_parser, call.reasoning_parser, "stop", True
            )
        output: list[Any] = []
        if text.strip() or not tool_calls:
            output.append(
                ResponseOutputMessage(
                    id=f"msg_{uuid.uuid4().hex[:29]}",
                    type="message",
                    role="assistant",
                    status="completed",
                    content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
                )
            )
        output += tool_calls or []
        reasoning_tokens = 0
        reasoning, _ = parse_reasoning(text, call.reasoning_parser)
        if reasoning:
            reasoning_tokens = len(self._call.tokenizer.encode(reasoning, add_special_tokens=False))
        response = Response(
            id=resp_id,
            object="response",
            created_at=float(int(time.time())),
            model="areal" if is_omitted(model) else str(model),
            output=output,
            parallel_tool_calls=False,
            tool_choice="auto" if is_omitted(tool_choice) else tool_choice,
            tools=flat_tools,
            temperature=None if is_omitted(temperature) else float(temperature),
            top_p=None if is_omitted(top_p) else float(top_p),
            instructions=None if is_omitted(instructions) else instructions,
            metadata=None if is_omitted(metadata) else dict(metadata),
            max_output_tokens=gconfig.max_new_tokens,
            status="incomplete" if engine_resp.stop_reason == "length" else "completed",
            usage=ResponseUsage(
                input_tokens=engine_resp.input_len,
                input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
                output_tokens=engine_resp.output_len,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                total_tokens=engine_resp.input_len + engine_resp.output_len,
            ),
        )
        interaction.response = response
        interaction.model_response = engine_resp
        interaction.output_message_list = response_items_to_messages(
            [o.model_dump(exclude_none=True) for o in output]
        )
        return response


class ArealOpenAI(AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose chat completions and responses run on ``engine``.

    Args:
        engine: anything with ``async agenerate(ModelRequest) -> ModelResponse`` (every
            ``InferenceEngine``, e.g. a connected ``RemoteInfEngine``).
        tokenizer: the served model's Hugging Face tokenizer (chat template included).
        tool_call_parser: ``qwen`` (= ``qwen25`` = ``hermes``): ``<tool_call>`` JSON blocks.
        reasoning_parser: ``qwen3`` or ``deepseek_r1``: ``<think>`` blocks.
        engine_max_tokens: cap on prompt + generated tokens of every call.
        chat_template_type: ``hf`` or ``concat`` (see the module docstring).
        **kwargs: forwarded to ``AsyncOpenAI`` (``api_key`` defaults to ``"none"``: no
            request ever leaves the process).
    """

    def __init__(
        self,
        engine: AsyncGenerateEngine,
        tokenizer: Any,
        tool_call_parser: str = "qwen",
        reasoning_parser: str = "qwen3",
        engine_max_tokens: int | None = None,
        chat_template_type: str = "hf",
        **kwargs: Any,
    ):
        if chat_template_type not in CHAT_TEMPLATE_TYPES:
            raise ValueError(
                f"chat_template_type={chat_template_type!r}; allowed: {list(CHAT_TEMPLATE_TYPES)}"
            )
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser={tool_call_parser!r}; allowed: {list(TOOL_CALL_PARSERS)}"
            )
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser={reasoning_parser!r}; allowed: {list(REASONING_PARSERS)}"
            )
        if engine_max_tokens is not None and engine_max_tokens < 2:
            raise ValueError(f"engine_max_tokens={engine_max_tokens}; must be >= 2")
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ValueError("ArealOpenAI needs a tokenizer with an EOS token")
        kwargs.setdefault("api_key", "none")
        super().__init__(**kwargs)
        self.engine = engine
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.engine_max_tokens = engine_max_tokens
        self.chat_template_type = chat_template_type
        self._cache = InteractionCache()
        call = _EngineCall(
            engine,
            tokenizer,
            self._cache,
            tool_call_parser,
            reasoning_parser,
            engine_max_tokens,
            chat_template_type,
        )
        # `chat`, `chat.completions` and `responses` are cached properties of the SDK
        # client: setting the instance attributes replaces them.
        self.chat.completions = AsyncCompletionsWithReward(self, call)
        self.responses = AsyncResponsesWithReward(self, call)

    @property
    def cache(self) -> InteractionCache:
        """The interactions recorded so far (in call order)."""
        return self._cache

    def get_interaction(self, id: str) -> InteractionWithTokenLogpReward | None:  # noqa: A002
        """The recorded interaction of a completion/response id, or None."""
        return self._cache.get(id)

    def set_reward(self, id: str, reward: float) -> None:  # noqa: A002 - AReaL's name
        """Set the reward of one completion/response (``KeyError`` if unknown)."""
        self._cache.set_reward(id, reward)

    def set_last_reward(self, reward: float) -> None:
        """Set the reward of the most recent completion/response."""
        if not self._cache:
            raise RuntimeError("no interaction recorded yet: nothing to reward")
        self._cache.set_last_reward(reward)

    def apply_reward_discount(
        self, turn_discount: float = 1.0
    ) -> dict[str, InteractionWithTokenLogpReward]:
        """``reward[i] += turn_discount * reward[i+1]`` from the newest call back (once)."""
        return self._cache.apply_reward_discount(turn_discount)

    def export_interactions(
        self, style: str, reward_discount: float | None = None
    ) -> dict[str, InteractionWithTokenLogpReward]:
        """``{id: interaction}``: all (``individual``) or conversation leaves (``concat``)."""
        return self._cache.export_interactions(style, reward_discount=reward_discount)
