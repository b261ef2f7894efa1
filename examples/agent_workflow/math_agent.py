"""The CPU arithmetic task as a plain OpenAI-SDK agent, trained through the proxy.

The agent below knows nothing about RL: it asks the model one question with the official
``openai`` SDK and scores the answer. ``PPOTrainer.train(workflow=MathAgent(...))``
recognises it as an agent (``async def run(data, **extra_kwargs)``), starts the
OpenAI-compatible proxy and trains on the exact tokens of every call.

    python examples/agent_workflow/math_agent.py --config examples/agent_workflow/agent_grpo_cpu.yaml
    # the control: the same run with rewards shuffled across episodes
    python examples/agent_workflow/math_agent.py --config examples/agent_workflow/agent_grpo_cpu.yaml \\
        +shuffle_rewards=true trial_name=shuffled

Held-out accuracy (greedy, 512 problems, scored against the true answers) is measured
through the same proxy before and after training and printed at the end.
"""

import asyncio
import collections
import os
import random
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer


class MathAgent:
    """One question, one answer, reward 1.0 when the final answer is right.

    ``shuffle_rewards=True`` is the control experiment: the agent returns the true reward
    of a *random earlier episode* instead of its own, so rewards keep their distribution
    but carry no information about this episode's answer.
    """

    def __init__(
        self,
        max_tokens: int = 48,
        temperature: float = 1.0,
        shuffle_rewards: bool = False,
        seed: int = 0,
    ):
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.shuffle_rewards = shuffle_rewards
        self._rng = random.Random(seed)
        self._pool: collections.deque[float] = collections.deque(maxlen=512)

    async def run(self, data: dict, **extra_kwargs) -> float:
        from openai import AsyncOpenAI

        from areal.reward.gsm8k import gsm8k_reward_fn

        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs.get("http_client"),
        )
        reply = await client.chat.completions.create(
            model="default",
            messages=data["messages"],
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        text = reply.choices[0].message.content or ""
        reward = await asyncio.to_thread(gsm8k_reward_fn, None, text, None, None, data["answer"])
        if not self.shuffle_rewards:
            return float(reward)
        self._pool.append(float(reward))
        return self._rng.choice(self._pool)


def main(argv: list[str]) -> None:
    shuffle = any(a.replace("+", "") == "shuffle_rewards=true" for a in argv)
    argv = [a for a in argv if not a.replace("+", "").startswith("shuffle_rewards=")]
    config, _ = load_expr_config(argv, GRPOConfig)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid = get_custom_dataset("test", config.valid_dataset, tokenizer)
    gen = config.gconfig
    agent = MathAgent(
        max_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        shuffle_rewards=shuffle,
        seed=config.seed,
    )
    greedy = MathAgent(max_tokens=config.eval_gconfig.max_new_tokens, temperature=0.0)
    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        # At most 10 minutes of training (or total_train_steps, whichever comes first).
        result = trainer.train(workflow=agent, eval_workflow=greedy, max_seconds=600)
    before = result.get("initial_eval", {}).get("eval/accuracy")
    after = result.get("final_eval", {}).get("eval/accuracy")
    print("=" * 72)
    print(f"rewards: {'SHUFFLED across episodes (control)' if shuffle else 'true'}")
    if before is not None:
        print(f"held-out greedy accuracy before RL: {before:.3f}")
    if after is not None:
        print(
            f"held-out greedy accuracy after  RL: {after:.3f}  ({result['total_steps']} steps, "
            f"{result['train_seconds']:.0f} s)"
        )
    print(f"stats: {os.path.join(result['log_dir'], 'stats.jsonl')}")


if __name__ == "__main__":
    main(sys.argv[1:])
