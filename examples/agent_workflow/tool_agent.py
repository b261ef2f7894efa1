"""A tool-calling agent written with ``openai-agents``, trained through the proxy.

The agent is an ordinary ``agents.Agent`` with a calculator ``function_tool``, run by
``agents.Runner`` against the OpenAI-compatible proxy (``OpenAIChatCompletionsModel`` on an
``AsyncOpenAI`` client built from the ``base_url`` / ``api_key`` / ``http_client`` the
trainer hands to every episode). The model is the shipped tiny tool-calling checkpoint
(``areal/models/assets/tiny-tool``), which was fine-tuned on deliberately imperfect
transcripts of 2-digit, 2-step word problems: it often calls the calculator with a wrong
expression or answers without calling it. The reward is 1.0 when the final answer is the
true result, so RL favours episodes that call the tool correctly and copy its result.

    python examples/agent_workflow/tool_agent.py --config examples/agent_workflow/tool_agent_cpu.yaml

Held-out tool use (greedy, 256 problems the checkpoint never saw) is measured through the
same proxy before and after training: the rate of episodes that call the tool, whose first
call evaluates to the true result, whose final answer is right, and tool-use success (a
correct call AND a correct final answer).
"""

import dataclasses
import json
import os
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer


@dataclasses.dataclass
class EpisodeLog:
    """Per-episode context of the ``Runner``: the expressions the tool was called with."""

    calls: list[str] = dataclasses.field(default_factory=list)
    results: list[str] = dataclasses.field(default_factory=list)


def true_result(answer: str) -> int:
    """``"... #### 64"`` (GSM8K format of the synthetic rows) -> 64."""
    return int(answer.rsplit("####", 1)[-1].strip())


def _calculator_tool():
    from agents import RunContextWrapper, function_tool

    from areal.models.tiny_tool import calculator as evaluate

    @function_tool
    def calculator(ctx: RunContextWrapper[EpisodeLog], expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        result = evaluate(expression)
        ctx.context.calls.append(expression)
        ctx.context.results.append(result)
        return result

    return calculator


class ToolAgent:
    """One ``openai-agents`` run per episode; returns 1.0 when the final answer is right.

    ``records`` (when ``record=True``) keeps one dict per episode with ``tool_called``,
    ``expression_correct``, ``answer_correct`` and ``success``: the evaluation figures.
    """

    def __init__(
        self,
        max_tokens: int = 48,
        temperature: float = 1.0,
        max_turns: int = 3,
        record: bool = False,
    ):
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_turns = max_turns
        self.record = record
        self.records: list[dict[str, bool]] = []
        self._tool = None

    async def run(self, data: dict, **extra_kwargs) -> float:
        import agents
        from openai import AsyncOpenAI

        from areal.models.tiny_tool import tool_answer_reward_fn

        agents.set_tracing_disabled(True)
        if self._tool is None:
            self._tool = _calculator_tool()
        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs.get("http_client"),
        )
        agent = agents.Agent(
            name="calculator-agent",
            tools=[self._tool],
            model=agents.OpenAIChatCompletionsModel(model="tiny-tool", openai_client=client),
            model_settings=agents.ModelSettings(
                max_tokens=self.max_tokens, temperature=self.temperature
            ),
        )
        log = EpisodeLog()
        question = data["messages"][-1]["content"]
        try:
            result = await agents.Runner.run(agent, question, context=log, max_turns=self.max_turns)
            final = str(result.final_output or "")
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):
            final = ""  # e.g. calls the tool again and again: no answer, reward 0
        target = true_result(data["answer"])
        answer_ok = tool_answer_reward_fn(final, target) == 1.0
        if self.record:
            expr_ok = bool(log.results) and log.results[0] == str(target)
            self.records.append(
                {
                    "tool_called": bool(log.calls),
                    "expression_correct": expr_ok,
                    "answer_correct": answer_ok,
                    "success": expr_ok and answer_ok,
                }
            )
        return float(answer_ok)


def summarize(records: list[dict[str, bool]]) -> dict[str, float]:
    n = max(1, len(records))
    keys = ("tool_called", "expression_correct", "answer_correct", "success")
    return {"n": len(records), **{k: sum(r[k] for r in records) / n for k in keys}}


def main(argv: list[str]) -> None:
    # `+max_seconds=N`: the training time cap (default 480 s), not a config field.
    max_seconds = 480.0
    for a in [a for a in argv if a.lstrip("+").startswith("max_seconds=")]:
        max_seconds = float(a.split("=", 1)[1])
        argv.remove(a)
    config, _ = load_expr_config(argv, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid = get_custom_dataset("test", config.valid_dataset, tokenizer)
    gen = config.gconfig
    agent = ToolAgent(max_tokens=gen.max_new_tokens, temperature=gen.temperature)
    greedy = ToolAgent(max_tokens=config.eval_gconfig.max_new_tokens, temperature=0.0, record=True)
    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        result = trainer.train(workflow=agent, eval_workflow=greedy, max_seconds=max_seconds)
    n = len(valid)
    # Evaluation runs before training and once at the end (evaluator.freq_steps: null).
    before = summarize(greedy.records[:n]) if len(greedy.records) >= 2 * n else None
    after = summarize(greedy.records[-n:])
    figures = {
        "before": before,
        "after": after,
        "total_steps": result["total_steps"],
        "train_seconds": round(result["train_seconds"], 1),
        "temperature": gen.temperature,
    }
    with open(os.path.join(result["log_dir"], "tool_agent_eval.json"), "w") as f:
        json.dump(figures, f, indent=2)
    print("=" * 72)
    print(
        f"held-out greedy tool use over {n} problems ({result['total_steps']} steps, "
        f"{result['train_seconds']:.0f} s of training at T={gen.temperature}):"
    )
    for key in ("tool_called", "expression_correct", "answer_correct", "success"):
        b = f"{before[key]:.3f}" if before else "  -  "
        print(f"  {key:20s} before {b}  after {after[key]:.3f}")
    print(f"stats: {os.path.join(result['log_dir'], 'stats.jsonl')}")


if __name__ == "__main__":
    main(sys.argv[1:])
