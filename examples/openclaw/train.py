"""Online RL entry: no dataset, no workflow; external clients drive the episodes.

    python examples/openclaw/train.py --config examples/openclaw/config.yaml [key=value ...]

With ``rollout.agent.mode: online`` the trainer starts the OpenAI-compatible proxy at
``rollout.agent.proxy_host:proxy_port`` and trains on the sessions clients end (see
README.md in this folder for the client side).
"""

import sys

from areal import PPOTrainer
from areal.api.cli_args import PPOConfig, load_expr_config


def main(argv: list[str]) -> None:
    config, _ = load_expr_config(argv, PPOConfig)
    with PPOTrainer(config) as trainer:
        trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
