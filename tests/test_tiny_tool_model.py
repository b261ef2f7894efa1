"""The shipped tiny tool-calling checkpoint: template, calculator, and its REAL greedy output.

No mocks: the model's own generations are parsed with the tool-call parser, and one test
runs the full tool round trip through ``ArealOpenAI`` on a real built-in server.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from areal.dataset.synthetic import ArithSpec, generate_arith_problems
from areal.experimental.openai.tool_call_parser import parse_tool_calls
from areal.models.tiny_tool import (
    CALCULATOR_TOOL,
    calculator,
    final_number,
    get_tiny_tool_path,
    run_calculator_call,
    tool_answer_reward_fn,
)

TOOLS = [CALCULATOR_TOOL]
# Held-out problems: a split the builder never trained on (it uses "train"/"test"/"tokenizer").
HELD_OUT = generate_arith_problems(
    ArithSpec(digits=2, steps=2, ops=("add", "sub"), n=8, seed=0), split="unit-test"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_tiny_tool_path())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(get_tiny_tool_path(), dtype=torch.float32).eval()


def _prompt(tokenizer, messages):
    out = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, add_generation_prompt=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@torch.no_grad()
def _greedy(model, tokenizer, ids, max_new_tokens=48):
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in out:
        out = out[: out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out, skip_special_tokens=True)


def _readme_greedy_call_rate(path: str) -> float:
    """The README table's greedy 'turn 1 is a valid calculator call' figure, as a fraction."""
    import re

    text = open(os.path.join(path, "README.md")).read()
    m = re.search(r"^\| turn 1 is a valid calculator call[^|]*\| ([\d.]+)% \|", text, re.M)
    assert m, "README.md lost its greedy valid-call row"
    return float(m.group(1)) / 100


def test_checkpoint_is_small_and_its_stated_greedy_call_rate_holds(model, tokenizer):
    path = get_tiny_tool_path()
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 8 * 2**20
    stated = _readme_greedy_call_rate(path)
    results = json.load(open(os.path.join(path, "build_results.json")))
    assert results["greedy"]["tool_call_rate"] == pytest.approx(stated, abs=5e-4)
    # re-measured on problems the builder never saw: at most one miss in 8 below the README
    n_valid = 0
    for row in HELD_OUT:
        text = _greedy(
            model, tokenizer, _prompt(tokenizer, [{"role": "user", "content": row["question"]}])
        )
        _, calls = parse_tool_calls(text, "qwen", TOOLS)
        n_valid += len(calls) == 1 and not run_calculator_call(calls[0].arguments).startswith(
            "error"
        )
    assert n_valid / len(HELD_OUT) >= stated - 1 / len(HELD_OUT), (n_valid, stated)


def test_chat_template_renders_tools_tool_calls_and_tool_messages(tokenizer):
    msgs = [
        {"role": "user", "content": "Q?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'},
                }
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    text = tokenizer.apply_chat_template(
        msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nTools: calculator<|im_end|>\n"
        "<|im_start|>user\nQ?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": '
        '{"expression": "1 + 2"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n3<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # arguments as a dict render identically; tool tokens are single, non-special tokens
    msgs[1]["tool_calls"][0]["function"]["arguments"] = {"expression": "1 + 2"}
    assert (
        tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        == text
    )
    ids = tokenizer.encode("<tool_call>x</tool_call>", add_special_tokens=False)
    assert len(ids) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_greedy_output_on_held_out_prompt_is_a_valid_calculator_call(model, tokenizer):
    row = HELD_OUT[0]
    text = _greedy(
        model, tokenizer, _prompt(tokenizer, [{"role": "user", "content": row["question"]}])
    )
    content, calls = parse_tool_calls(text, "qwen", TOOLS)
    assert len(calls) == 1, text
    assert calls[0].name == "calculator"
    args = calls[0].arguments_dict()
    assert set(args) == {"expression"}
    assert not run_calculator_call(args).startswith("error"), args


@pytest.mark.parametrize(
    "expr, out",
    [
        ("31 + 45 - 12", "64"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("-3 + 1", "-2"),
        ("1 / 0", "error: division by zero"),
    ],
)
def test_calculator_evaluates_arithmetic(expr, out):
    assert calculator(expr) == out


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 10", "x + 1", "1e400 * 1e400", "[1]"])
def test_calculator_refuses_anything_but_arithmetic(expr):
    assert calculator(expr).startswith("error")


def test_answer_reward_uses_last_number():
    assert final_number("The answer is 64.") == "64"
    assert tool_answer_reward_fn("I think 3, no: The answer is 64.", 64) == 1.0
    assert tool_answer_reward_fn("The answer is 63.", 64) == 0.0
    assert tool_answer_reward_fn("no number", 64) == 0.0
    assert run_calculator_call("not json").startswith("error")
    assert run_calculator_call({"expr": "1"}).startswith("error")


def test_context_holds_4096_positions_and_short_prompt_outputs_are_unchanged(model, tokenizer):
    """4,096 positions (agent SDK prompts with tool schemas fit); RoPE has no position
    table, so the same weights under the old 1,024 give identical logits on short prompts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    assert model.config.max_position_embeddings >= 4096
    assert tokenizer.model_max_length >= 4096
    cfg = AutoConfig.from_pretrained(get_tiny_tool_path())
    cfg.max_position_embeddings = 1024
    old = AutoModelForCausalLM.from_pretrained(
        get_tiny_tool_path(), config=cfg, dtype=torch.float32
    ).eval()
    ids = torch.tensor([_prompt(tokenizer, [{"role": "user", "content": HELD_OUT[1]["question"]}])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, old(ids).logits)


@pytest.fixture(scope="module")
def tool_engine():
    from _local_engine import local_engine

    with local_engine(get_tiny_tool_path()) as eng:
        yield eng


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_tool_round_trip_through_areal_openai_on_real_server(tokenizer, tool_engine):
    """The model's own call -> calculator -> tool message -> final answer, all recorded."""
    from areal.experimental.openai import ArealOpenAI

    row = HELD_OUT[0]
    client = ArealOpenAI(engine=tool_engine, tokenizer=tokenizer, chat_template_type="concat")
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(
        messages=messages, tools=TOOLS, temperature=0, max_tokens=48
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    result = run_calculator_call(call.function.arguments)
    assert not result.startswith("error")
    messages += [choice.message, {"role": "tool", "content": result, "tool_call_id": call.id}]
    second = await client.chat.completions.create(
        messages=messages, tools=TOOLS, temperature=0, max_tokens=24
    )
    answer = second.choices[0].message
    # the model's own final answer (it may copy the result wrongly: it is imperfect)
    assert not answer.tool_calls and answer.content.startswith("The answer is")
    assert final_number(answer.content) is not None
    client.set_last_reward(tool_answer_reward_fn(answer.content, row["result"]))

    leaves = client.export_interactions(style="concat")
    assert list(leaves) == [second.id]
    row_t = leaves[second.id].to_tensor_dict()
    it1, it2 = client.get_interaction(first.id), client.get_interaction(second.id)
    assert it2.parent is it1
    ids = row_t["input_ids"][0].tolist()
    r1, r2 = it1.model_response, it2.model_response
    assert ids[: r1.input_len + r1.output_len] == r1.input_tokens + r1.output_tokens
    assert ids == r2.input_tokens + r2.output_tokens
    mask = row_t["loss_mask"][0].tolist()
    # trained on: the call and the answer; not on the prompt, the tool result, the template
    assert sum(mask) == r1.output_len + r2.output_len
    tool_span = ids[r1.input_len + r1.output_len : r2.input_len]
    assert result in tokenizer.decode(tool_span) and not any(
        mask[r1.input_len + r1.output_len : r2.input_len]
    )
    assert tokenizer.decode(ids[r1.input_len : r1.input_len + r1.output_len]).startswith(
        "<tool_call>"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_real_server_accepts_a_prompt_past_the_old_1024_positions(tokenizer, tool_engine):
    """A 2,000-token prompt (the openai-agents SDK's with tool schemas: ~1,134) is
    generated on, not refused."""
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    ids = _prompt(tokenizer, [{"role": "user", "content": "1 + 2 " * 700 + "= ?"}])
    assert 1500 < len(ids) < 4000, len(ids)
    resp = await tool_engine.agenerate(
        ModelRequest(input_ids=ids, gconfig=GenerationHyperparameters(max_new_tokens=4))
    )
    assert len(resp.output_tokens) >= 1
