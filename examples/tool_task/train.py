"""Train the necessary-tool task: a multi-call calculator agent, one training row per call.

    python examples/tool_task/train.py --config examples/tool_task/config_cpu.yaml
    # the control (training rewards permuted within each batch):
    python benchmarks/claims/reward_control.py --rewards shuffled \\
        examples/tool_task/train.py --config examples/tool_task/config_cpu.yaml

What happens, in order:

1. The config is read; the datasets are the seeded ``A * B + C`` problems of
   ``train_dataset.path`` / ``valid_dataset.path`` (``tool_arith://?n=N&seed=S``, splits
   ``train`` and ``test``; :mod:`areal.dataset.tool_arith`).
2. ``PPOTrainer.train`` runs :class:`ToolArithAgent` (``examples/tool_task/agent.py``)
   through the OpenAI-compatible proxy: every model call of an episode is one training row
   (``rollout.agent.export_style: individual``), groups of ``n_samples`` episodes share
   the advantage baseline, the episode's reward reaching each of its calls.
3. Held-out greedy episodes (tool executed, scored on the true answer) are run before
   training and at the end; the figures are printed and written to
   ``<log_dir>/tool_task_eval.json``.

``+max_seconds=N`` caps the training time (default 840 s); it is not a config field.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under runpy
from agent import ToolArithAgent, summarize  # noqa: E402

from areal import PPOTrainer  # noqa: E402
from areal.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal.dataset.tool_arith import tool_arith_dataset  # noqa: E402


def main(argv: list[str]) -> None:
    max_seconds = 840.0
    for a in [a for a in argv if a.lstrip("+").startswith("max_seconds=")]:
        max_seconds = float(a.split("=", 1)[1])
        argv.remove(a)
    config, _ = load_expr_config(argv, GRPOConfig)
    train = tool_arith_dataset(config.train_dataset.path, "train")
    valid = tool_arith_dataset(config.valid_dataset.path, "test")
    gen = config.gconfig
    agent = ToolArithAgent(max_tokens=gen.max_new_tokens, temperature=gen.temperature)
    greedy = ToolArithAgent(
        max_tokens=config.eval_gconfig.max_new_tokens, temperature=0.0, record=True
    )
    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        result = trainer.train(workflow=agent, eval_workflow=greedy, max_seconds=max_seconds)
    n = len(valid)
    before = summarize(greedy.records[:n]) if len(greedy.records) >= 2 * n else None
    after = summarize(greedy.records[-n:])
    figures = {
        "before": before,
        "after": after,
        "total_steps": result["total_steps"],
        "train_seconds": round(result["train_seconds"], 1),
    }
    with open(os.path.join(result["log_dir"], "tool_task_eval.json"), "w") as f:
        json.dump(figures, f, indent=2)
    print("=" * 72)
    print(
        f"held-out greedy episodes over {n} problems ({result['total_steps']} steps, "
        f"{result['train_seconds']:.0f} s of training):"
    )
    for key in ("success", "tool_called", "model_calls"):
        b = f"{before[key]:.3f}" if before else "  -  "
        print(f"  {key:12s} before {b}  after {after[key]:.3f}")
    print(f"stats: {os.path.join(result['log_dir'], 'stats.jsonl')}")


if __name__ == "__main__":
    main(sys.argv[1:])
