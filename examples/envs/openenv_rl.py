"""Train on an OpenEnv server, unchanged, with asynchronous GRPO through the proxy.

    python examples/envs/openenv_rl.py --config examples/agent_workflow/agent_grpo_cpu.yaml
    python examples/envs/openenv_rl.py --config ... +base_url=http://127.0.0.1:8000

Without ``+base_url`` the trainer starts ``+app=`` (default: this folder's
``arith_openenv_server:app``) with uvicorn on 127.0.0.1. One episode per dataset row:
``reset(seed=i)``, then model turn / ``step`` until ``done`` (at most ``+max_turns``);
each call gets its step's reward.
"""

import os
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.workflow.openenv import OpenEnvAgent, openenv_rows


def main(argv: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # arith_openenv_server
    extra = {a.lstrip("+").split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("+")}
    argv = [a for a in argv if not a.startswith("+")]
    config, _ = load_expr_config(argv, GRPOConfig)
    server = (
        {"base_url": extra["base_url"]}
        if "base_url" in extra
        else {"app": extra.get("app", "arith_openenv_server:app")}
    )
    agent = OpenEnvAgent(
        **server,
        max_turns=int(extra.get("max_turns", 2)),
        temperature=config.gconfig.temperature,
        max_completion_tokens=config.gconfig.max_new_tokens,
    )
    steps = config.total_train_steps or 100
    rows = openenv_rows(steps * config.train_dataset.batch_size, seed=0)
    with PPOTrainer(config, train_dataset=rows) as trainer:
        result = trainer.train(workflow=agent)
    print("steps", result["steps_done"], "stats", os.path.join(result["log_dir"], "stats.jsonl"))


if __name__ == "__main__":
    main(sys.argv[1:])
