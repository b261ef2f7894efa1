"""Train a verifiers environment, unchanged, with asynchronous GRPO through the proxy.

    python examples/envs/verifiers_rl.py --config examples/agent_workflow/agent_grpo_cpu.yaml \\
        +env=arith_vf_env:load_environment

``+env=`` names the environment: an installed Environments Hub id (``vf.load_environment``)
or ``module:function``; ``+env_args='{"n": 2000}'`` (JSON) are its arguments. The
environment's dataset is the training set, its eval dataset the held-out set; its
rubric's weighted reward is each episode's reward.
"""

import json
import os
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.workflow.verifiers import VerifiersAgent, environment_datasets


def main(argv: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # arith_vf_env
    extra = {a.lstrip("+").split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("+")}
    argv = [a for a in argv if not a.startswith("+")]
    env_id = extra.get("env", "arith_vf_env:load_environment")
    env_args = json.loads(extra.get("env_args", "{}"))
    config, _ = load_expr_config(argv, GRPOConfig)
    train, valid = environment_datasets(env_id, env_args)

    def agent(gconfig) -> VerifiersAgent:
        return VerifiersAgent(
            env=env_id,
            env_args=env_args,
            group_size=config.gconfig.n_samples,
            eval_group_size=config.eval_gconfig.n_samples,
            temperature=0.0 if gconfig.greedy else gconfig.temperature,
            max_completion_tokens=gconfig.max_new_tokens,
        )

    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        result = trainer.train(
            workflow=agent(config.gconfig), eval_workflow=agent(config.eval_gconfig)
        )
    for name in ("initial_eval", "final_eval"):
        print(name, result.get(name, {}).get("eval-rollout/reward"))


if __name__ == "__main__":
    main(sys.argv[1:])
