"""Tool-call and reasoning parsing (areal.experimental.openai.tool_call_parser)."""

from __future__ import annotations

import json

import pytest

from areal.experimental.openai.tool_call_parser import (
    parse_reasoning,
    parse_tool_calls,
    process_tool_calls,
)

CALC = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object"}},
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "31 + 45 - 12"}}</tool_call>'


def test_parse_single_call_returns_name_and_json_arguments():
    content, calls = parse_tool_calls(CALL, "qwen", [CALC])
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("calculator", {"expression": "31 + 45 - 12"})
    ]


@pytest.mark.parametrize("parser", ["qwen", "qwen25", "hermes"])
def test_parse_two_calls_with_whitespace_and_text_keeps_text_in_order(parser):
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n'
        '</tool_call>\n<tool_call>{"name": "calculator", "parameters": {"expression": "3"}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, parser, [CALC])
    assert content == "Let me compute."
    assert [c.arguments_dict() for c in calls] == [{"expression": "1+2"}, {"expression": "3"}]


def test_arguments_given_as_json_string_are_decoded():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
    _, calls = parse_tool_calls(text, "qwen", [CALC])
    assert calls[0].arguments_dict() == {"expression": "2*3"}


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>',  # not offered
    ],
)
def test_malformed_or_unknown_calls_stay_in_content(block):
    content, calls = parse_tool_calls("x " + block, "qwen", [CALC])
    assert calls == [] and content == "x " + block


def test_unclosed_block_is_not_a_call():
    text = '<tool_call>{"name": "calculator", "arguments": {}}'
    assert parse_tool_calls(text, "qwen", [CALC]) == (text, [])


def test_unknown_parser_name_raises_listing_allowed():
    with pytest.raises(ValueError, match="allowed"):
        parse_tool_calls(CALL, "llama3_json")


def test_reasoning_split_and_truncated_reasoning():
    assert parse_reasoning("<think> hmm </think>\nThe answer is 4.") == ("hmm", "The answer is 4.")
    assert parse_reasoning("<think>still going") == ("still going", "")
    assert parse_reasoning("no thinking") == (None, "no thinking")
    # deepseek_r1: the opening tag was in the prompt
    assert parse_reasoning("plan</think>done", "deepseek_r1") == ("plan", "done")
    assert parse_reasoning("plan</think>done", "qwen3") == (None, "plan</think>done")


def test_process_tool_calls_returns_openai_typed_calls_and_tool_calls_finish():
    from openai.types.chat.chat_completion_message_function_tool_call import (
        ChatCompletionMessageFunctionToolCall,
    )

    text = "<think>use the tool</think>" + CALL
    calls, rest, finish = process_tool_calls(text, [CALC], "qwen", "qwen3", "stop")
    assert finish == "tool_calls"
    assert isinstance(calls[0], ChatCompletionMessageFunctionToolCall)
    assert calls[0].function.name == "calculator" and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"expression": "31 + 45 - 12"}
    assert rest == "<think>use the tool</think>"  # reasoning stays, call removed


def test_process_tool_calls_responses_api_and_length_finish_kept():
    from openai.types.responses.response_function_tool_call import ResponseFunctionToolCall

    flat = [{"type": "function", "name": "calculator", "parameters": {}}]
    calls, _, finish = process_tool_calls(CALL, flat, "hermes", "qwen3", "length", True)
    assert isinstance(calls[0], ResponseFunctionToolCall) and calls[0].name == "calculator"
    assert finish == "length"


def test_process_tool_calls_without_call_returns_text_unchanged():
    assert process_tool_calls("The answer is 5.", [CALC], "qwen", "qwen3", "stop") == (
        None,
        "The answer is 5.",
        "stop",
    )
