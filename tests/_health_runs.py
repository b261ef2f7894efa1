"""Runs of the CPU demo with a failure induced, for ``tests/test_run_health_alarms.py``
and ``benchmarks/bench_run_health.py``.

The demo's configuration (``areal.demo.build_config``: the shipped tiny model, synthetic
word problems) at a smaller batch, trained through a real ``PPOTrainer``, with:

- ``HealthScriptWorkflow``: ``RLVRWorkflow`` whose reward follows a schedule by policy
  version: ``task`` (the demo's correctness reward), ``zero`` / ``constant`` (0.0 / 1.0
  for every answer: no group has a signal; on the un-normalised reward ``zero`` gives no
  update and ``constant`` reinforces every sampled token) or ``length`` (the completion's share of ``max_new_tokens``: a
  reward a policy can game by talking longer);
- ``CorruptWeightsHook``: a weight-sync hook that, from a version on, replaces what the
  servers loaded by a perturbed copy of the exported weights before the version is
  committed (a weight sync that silently delivers wrong weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch
from _jsonl import read_jsonl

from areal.infra.weights.weight_sync import WeightSyncHook
from areal.workflow.rlvr import RLVRWorkflow

# A small, fast demo: 4 prompts x 4 answers a step, 48 new tokens, 32 held-out problems.
SMALL = (
    "train_dataset.batch_size=4",
    "gconfig.n_samples=4",
    "actor.group_size=4",
    "actor.reward_norm.group_size=4",
    "rollout.max_concurrent_rollouts=16",
)


def demo_config(fileroot: str, steps: int, *overrides: str, eval_n: int = 32) -> Any:
    from areal.demo import build_config

    return build_config(
        [f"--steps={steps}", f"--eval-n={eval_n}", f"--fileroot={fileroot}", *SMALL, *overrides]
    )


class HealthScriptWorkflow(RLVRWorkflow):
    """``RLVRWorkflow`` whose reward is chosen by the policy version (module docstring).

    ``schedule``: ``[(from_version, mode), ...]`` sorted by version; the last entry whose
    ``from_version`` is at most the episode's version applies."""

    def __init__(self, schedule: list[tuple[int, str]] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.schedule = list(schedule or [(0, "task")])
        for _, mode in self.schedule:
            if mode not in ("task", "zero", "constant", "length"):
                raise ValueError(f"schedule mode {mode!r}; allowed: task, zero, constant, length")

    def _mode(self, version: int) -> str:
        mode = "task"
        for start, m in self.schedule:
            if version >= start:
                mode = m
        return mode

    async def arun_episode(self, engine, data):
        mode = self._mode(int(engine.get_version()))
        out = await super().arun_episode(engine, data)
        if out is None or mode == "task":
            return out
        if mode in ("zero", "constant"):
            fill = torch.zeros_like if mode == "zero" else torch.ones_like
            out["rewards"] = fill(out["rewards"].float())
        else:
            n = out["loss_mask"].sum(-1).float()
            out["rewards"] = (n / float(self.gconfig.max_new_tokens)).clamp(max=1.0)
        return out


class CorruptWeightsHook(WeightSyncHook):
    """From ``from_version`` on, every server serves a noisy copy of the pushed weights
    (Gaussian noise of ``scale`` times each tensor's standard deviation), committed as if
    it were the trainer's."""

    def __init__(self, from_version: int, scale: float = 0.5, seed: int = 0):
        self.from_version = int(from_version)
        self.scale = float(scale)
        self.seed = int(seed)
        self.corrupted: list[int] = []

    def verify(self, ctx: Any) -> None:
        if ctx.version < self.from_version or ctx.meta.type != "disk" or not ctx.meta.path:
            return
        if ctx.reason != "step":
            return
        from safetensors.torch import load_file, save_file

        from areal.infra.weights.transports import resolve

        src = ctx.meta.path
        dst = src.rstrip("/") + "-corrupt"
        os.makedirs(dst, exist_ok=True)
        g = torch.Generator().manual_seed(self.seed + ctx.version)
        for name in os.listdir(src):
            path = os.path.join(src, name)
            if name.endswith(".safetensors"):
                tensors = load_file(path)
                for k, t in tensors.items():
                    if t.is_floating_point() and t.numel() > 1:
                        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
                        std = float(t.float().std())
                        tensors[k] = (t.float() + self.scale * std * noise).to(t.dtype)
                save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
            elif os.path.isfile(path):
                with open(path, "rb") as f, open(os.path.join(dst, name), "wb") as g2:
                    g2.write(f.read())
        bad = dataclasses.replace(ctx.meta, path=dst)
        resolve(ctx.rollout.update_weights_from_disk(bad), "update_weights_from_disk")
        self.corrupted.append(ctx.version)


class SyncLog(WeightSyncHook):
    """Records ``(reason, version)`` of every successful sync."""

    def __init__(self) -> None:
        self.syncs: list[tuple[str, int]] = []

    def after_sync(self, ctx: Any) -> None:
        self.syncs.append((ctx.reason, int(ctx.version)))


def run_demo(
    config: Any,
    schedule: list[tuple[int, str]] | None = None,
    corrupt_from: int | None = None,
) -> dict[str, Any]:
    """Train ``config`` with ``HealthScriptWorkflow(schedule)`` (and the corrupting hook
    from ``corrupt_from``); returns the trainer's result plus ``health`` (the events of
    ``health.jsonl``), ``rows`` (``stats.jsonl``) and ``syncs`` (reason, version of every
    weight sync)."""
    from areal import PPOTrainer
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train = get_custom_dataset("train", config.train_dataset, tokenizer)
    valid = get_custom_dataset("test", config.valid_dataset, tokenizer)
    kwargs = dict(
        reward_fn="areal.reward.gsm8k.gsm8k_reward_fn",
        gconfig=config.gconfig,
        tokenizer=config.tokenizer_path,
        enable_thinking=False,
    )
    eval_kwargs = dict(kwargs, gconfig=config.eval_gconfig, rollout_stat_scope="eval-rollout")
    with PPOTrainer(config, train_dataset=train, valid_dataset=valid) as trainer:
        if corrupt_from is not None:
            trainer.weight_sync.add_hook(CorruptWeightsHook(corrupt_from))
        sync_log = SyncLog()
        trainer.weight_sync.add_hook(sync_log)
        result = trainer.train(
            workflow=HealthScriptWorkflow,
            workflow_kwargs=dict(kwargs, schedule=schedule),
            eval_workflow="areal.workflow.rlvr.RLVRWorkflow",
            eval_workflow_kwargs=eval_kwargs,
        )
    log_dir = result["log_dir"]
    result["health"] = read_jsonl(os.path.join(log_dir, "health.jsonl"))
    result["rows"] = read_jsonl(os.path.join(log_dir, "stats.jsonl"))
    result["syncs"] = sync_log.syncs
    return result


if __name__ == "__main__":  # quick experiments: python tests/_health_runs.py ROOT STEPS k=v...
    root, steps, *rest = sys.argv[1:]
    sched = None
    corrupt = None
    extra = []
    for a in rest:
        if a.startswith("schedule="):
            sched = [(int(p.split(":")[0]), p.split(":")[1]) for p in a[9:].split(",")]
        elif a.startswith("corrupt_from="):
            corrupt = int(a.split("=")[1])
        else:
            extra.append(a)
    res = run_demo(demo_config(root, int(steps), *extra), sched, corrupt)
    keys = (
        "batch/reward",
        "ppo_actor/update/entropy/avg",
        "batch/gen_len",
        "rollout/no_eos",
        "ppo_actor/update/importance_weight/avg",
        "ppo_actor/update/approx_kl/avg",
        "ppo_actor/update/clip_ratio/avg",
        "consistency/logp_absdiff_avg",
        "eval-rollout/reward",
    )
    for r in res["rows"]:
        print(
            r["global_step"],
            " ".join(f"{k.split('/')[-2]}={r.get(k, float('nan')):.4f}" for k in keys),
        )
    for e in res["health"]:
        print(json.dumps(e))
