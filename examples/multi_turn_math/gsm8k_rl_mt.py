"""Multi-turn GRPO on GSM8K-format math: retry with feedback when the answer is wrong.

    python examples/multi_turn_math/gsm8k_rl_mt.py --config examples/multi_turn_math/gsm8k_grpo_mt_cpu.yaml

Two workflows, chosen with ``workflow`` in the YAML (or ``workflow=openai`` on the command
line):

- ``multi_turn`` (default): :class:`areal.workflow.multi_turn.MultiTurnWorkflow`: one
  token sequence per episode; answer, check, append a feedback turn, answer again, up to
  ``agent_run_args.max_turns``; reward discounted by ``agent_run_args.turn_discount`` per
  extra turn.
- ``openai``: the same episode written as an agent against the OpenAI API
  (:class:`MultiturnRLVRWorkflow` below, as in AReaL's example): ``ArealOpenAI`` serves
  ``chat.completions.create`` from the inference engine and records every call;
  ``export_style`` ``concat`` returns one sequence per conversation, ``individual`` one
  row per call.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from areal import PPOTrainer
from areal.api.cli_args import GenerationHyperparameters, GRPOConfig, load_expr_config
from areal.api.workflow_api import RolloutWorkflow
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer
from areal.utils.stats_logger import StatsLogger

FEEDBACK = (
    "Your answer is either wrong or not parsable to the reward function. You may "
    "misunderstand the original question. Please carefully read the original question, "
    "check the previous errors, and try to answer it again."
)


@dataclass
class MultiTurnGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the multi-turn example's fields (AReaL's names)."""

    agent_run_args: dict = field(
        default_factory=dict,
        metadata={"help": "Episode arguments: max_turns (default 2), turn_discount (0.9)."},
    )
    export_style: str = field(
        default="concat",
        metadata={"help": "workflow=openai: 'concat' (one row per conversation) or 'individual'."},
    )
    workflow: str = field(
        default="multi_turn",
        metadata={"help": "'multi_turn' (MultiTurnWorkflow) or 'openai' (ArealOpenAI agent)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.export_style not in ("concat", "individual"):
            raise ValueError(f"export_style={self.export_style!r}; allowed: 'concat', 'individual'")
        if self.workflow not in ("multi_turn", "openai"):
            raise ValueError(f"workflow={self.workflow!r}; allowed: 'multi_turn', 'openai'")


def math_reward_fn(result: str, answer: str) -> float:
    """1.0 when ``result``'s final answer matches ``answer`` (GSM8K rules)."""
    from areal.reward.gsm8k import gsm8k_reward_fn

    return gsm8k_reward_fn("", result or "", [], [], answer=answer)


class MultiturnRLVRWorkflow(RolloutWorkflow):
    """The multi-turn episode as an OpenAI-API agent over ``ArealOpenAI``."""

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        export_style: str = "concat",
        max_turns: int = 2,
        turn_discount: float = 0.9,
    ):
        from areal.api.reward_api import AsyncRewardWrapper

        if isinstance(tokenizer, str):
            tokenizer = load_hf_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new(n_samples=1)
        self.export_style = export_style
        self.chat_template_type = "concat" if export_style == "concat" else "hf"
        self.max_turns = int(max_turns)
        self.turn_discount = float(turn_discount)
        self.async_reward_fn = AsyncRewardWrapper(math_reward_fn)

    async def arun_episode(self, engine, data):
        from areal.experimental.openai import ArealOpenAI

        client = ArealOpenAI(
            engine=engine, tokenizer=self.tokenizer, chat_template_type=self.chat_template_type
        )
        messages = list(data["messages"])
        reward = 0.0
        for _ in range(self.max_turns):
            completion = await client.chat.completions.create(
                messages=messages,
                temperature=0.0 if self.gconfig.greedy else self.gconfig.temperature,
                max_completion_tokens=self.gconfig.max_new_tokens,
            )
            message = completion.choices[0].message
            messages.append(message)
            reward = await self.async_reward_fn(result=message.content, answer=data["answer"])
            client.set_reward(completion.id, reward)
            if reward == 1:
                break
            messages.append({"role": "user", "content": FEEDBACK})
        client.apply_reward_discount(turn_discount=self.turn_discount)
        return client.export_interactions(style=self.export_style)


def main(args):
    config, _ = load_expr_config(args, MultiTurnGRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid_dataset = (
        get_custom_dataset("test", config.valid_dataset, tokenizer)
        if config.valid_dataset is not None
        else None
    )
    run = dict(config.agent_run_args)
    max_turns = int(run.get("max_turns", 2))
    turn_discount = float(run.get("turn_discount", 0.9))

    if config.workflow == "multi_turn":
        workflow = "areal.workflow.multi_turn.MultiTurnWorkflow"
        workflow_kwargs = dict(
            reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
            gconfig=config.gconfig,
            tokenizer=config.tokenizer_path,
            max_turns=max_turns,
            turn_discount=turn_discount,
        )
    else:
        workflow = MultiturnRLVRWorkflow
        workflow_kwargs = dict(
            gconfig=config.gconfig,
            tokenizer=config.tokenizer_path,
            export_style=config.export_style,
            max_turns=max_turns,
            turn_discount=turn_discount,
        )
    eval_workflow_kwargs = dict(workflow_kwargs, gconfig=config.eval_gconfig)

    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        result = trainer.train(
            workflow=workflow,
            workflow_kwargs=workflow_kwargs,
            eval_workflow=workflow,
            eval_workflow_kwargs=eval_workflow_kwargs,
        )

    log_dir = StatsLogger.get_log_path(config.stats_logger)
    before = result.get("initial_eval", {}).get("eval/accuracy")
    after = result.get("final_eval", {}).get("eval/accuracy")
    print("=" * 72)
    print(f"workflow {config.workflow}, max_turns {max_turns}, turn_discount {turn_discount}")
    if before is not None:
        print(f"held-out success within {max_turns} turns before RL: {before:.3f}")
    if after is not None:
        print(f"held-out success within {max_turns} turns after  RL: {after:.3f}")
    print(f"stats: {os.path.join(result.get('log_dir', log_dir), 'stats.jsonl')}")


if __name__ == "__main__":
    main(sys.argv[1:])
