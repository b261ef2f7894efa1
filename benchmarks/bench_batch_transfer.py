"""Bytes and seconds moved between the controller and the training workers per PPO step,
before (the batch shipped in every call) and after (held on the workers, sent once),
printed as one JSON object.

The training half of a PPO step (``areal.trainer.rl_step.train_on_batch``: proximal
logprobs, [reference logprobs,] advantages, ``ppo_update``, LR step) runs on real RPC
workers hosting ``FSDPPPOActor`` on the demo's tiny model and configuration
(``examples/math/gsm8k_grpo_cpu.yaml``, CPU, gloo), with ``held=False`` (the old path)
and ``held=True`` (the new one), on two batches:

- ``demo``: the demo's batch shape, 16 prompts x 8 samples = 128 sequences, padded to 96
  tokens (prompt ~40-56, up to 48 generated);
- ``large``: 512 sequences x 1,024 tokens.

Per path and batch: ``bytes_per_step`` (request + response bodies of every RPC call),
``batch_copies_sent`` (bytes sent to a role's workers / the batch's bytes: 1.0 means the
batch crossed once), ``transfer_s_per_step`` (the calls' wall time minus the workers'
execution time: pickling, HTTP on loopback, unpickling; ``areal.infra.rpc.traffic``),
``step_s`` and ``transfer_fraction`` = transfer / step.

``--large-engine transfer`` runs the large batch on :class:`TransferOnlyActor` instead:
the same calls with results of the same shapes and dtypes as ``FSDPPPOActor``'s, no model,
so its figures are the transfer alone (minutes instead of an hour of CPU forward and
backward passes); its ``step_s`` is then the demo's measured seconds per token times the
large batch's tokens (``step_s_source`` says which).

Usage: ``.venv/bin/python benchmarks/bench_batch_transfer.py [--steps 2] [--skip-large]
[--large-engine real|transfer] [--ref]`` (``--ref``: a reference model role too,
``actor.kl_ctl=0.01``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from areal.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal.api.io_struct import FinetuneSpec  # noqa: E402
from areal.infra.controller import start_train_controller  # noqa: E402
from areal.infra.rpc.traffic import RPC_TRAFFIC  # noqa: E402
from areal.infra.scheduler.local import LocalScheduler  # noqa: E402
from areal.trainer.rl_step import PPORoles, train_on_batch  # noqa: E402

ACTOR = "areal.trainer.ppo.actor.FSDPPPOActor"
TRANSFER_ONLY = "benchmarks.bench_batch_transfer.TransferOnlyActor"


class TransferOnlyActor:
    """``FSDPPPOActor``'s RPC surface without a model: every result has the shape and dtype
    of the real one (``compute_advantages`` adds the same six entries)."""

    def __init__(self, config=None):
        self.config = config

    def initialize(self, addr=None, ft_spec=None, **kwargs) -> None:
        pass

    def destroy(self) -> None:
        pass

    def compute_logp(self, data: dict) -> torch.Tensor:
        return torch.zeros(data["input_ids"].shape, dtype=torch.float32)

    def compute_advantages(self, data: dict) -> dict:
        shape = data["input_ids"].shape
        for key in ("advantages", "old_logp", "prox_logp", "kl_rewards", "tot_rewards"):
            data[key] = torch.zeros(shape, dtype=torch.float32)
        data["task_rewards"] = data["rewards"].float()
        return data

    def ppo_update(self, data: dict) -> list[dict[str, float]]:
        return [{"loss": 0.0, "grad_norm": 0.0, "lr": 5e-5} for _ in range(2)]

    def step_lr_scheduler(self) -> None:
        pass


def make_batch(n: int, T: int, prompt: tuple[int, int], gen_max: int, seed: int) -> dict:
    """A right-padded rollout batch like the demo's (vocab 384, groups of 8)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    g_len = torch.randint(max(1, gen_max // 4), gen_max + 1, (n,), generator=g)
    total = (p_len + g_len).clamp(max=T)
    pos = torch.arange(T)[None]
    attn = (pos < total[:, None]).long()
    loss = attn * (pos >= p_len[:, None]).long()
    ids = torch.randint(4, 384, (n, T), generator=g) * attn
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "logprobs": (-torch.rand(n, T, generator=g) * 3) * loss,
        "versions": torch.zeros(n, T, dtype=torch.long),
        "rewards": (torch.rand(n, generator=g) > 0.5).float(),
    }


def nbytes(batch: dict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))


def measure(roles: PPORoles, config, batch: dict, held: bool, steps: int) -> dict:
    timings: dict[str, float] = {}

    @contextmanager
    def timed(name):
        t0 = time.monotonic()
        yield
        timings[name] = timings.get(name, 0.0) + time.monotonic() - t0

    RPC_TRAFFIC.reset()
    t0 = time.monotonic()
    for v in range(steps):
        train_on_batch(roles, batch, config, v, timed, held=held)
    step_s = (time.monotonic() - t0) / steps
    per_role = {r: t.as_dict() for r, t in RPC_TRAFFIC.by_role().items()}
    size = nbytes(batch)
    total = {k: sum(t[k] for t in per_role.values()) / steps for k in ("bytes", "transfer_s")}
    snap = sorted(RPC_TRAFFIC.snapshot().items())
    calls = {f"{w}:{m}": t.calls // steps for (w, m), t in snap}
    call_s = {f"{w}:{m}": t.transfer_s / steps for (w, m), t in snap}
    return {
        "step_s": step_s,
        "bytes_per_step": int(total["bytes"]),
        "transfer_s_per_step": total["transfer_s"],
        "transfer_fraction": total["transfer_s"] / step_s,
        "roles": {
            r: {
                "bytes_sent_per_step": int(t["bytes_sent"] / steps),
                "bytes_received_per_step": int(t["bytes_received"] / steps),
                "batch_copies_sent": t["bytes_sent"] / steps / size,
                "transfer_s_per_step": t["transfer_s"] / steps,
            }
            for r, t in per_role.items()
        },
        "calls_per_step": calls,
        "transfer_s_per_call": call_s,
        "timings_s": {k: v / steps for k, v in timings.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="measured steps per path (demo batch)")
    ap.add_argument("--large-steps", type=int, default=1)
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--ref", action="store_true", help="add a reference-model role")
    ap.add_argument("--large-engine", choices=["real", "transfer"], default="real")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="bench_batch_transfer_")
    overrides = [
        f"cluster.fileroot={root}",
        "actor.mb_spec.max_tokens_per_mb=16384",
        f"actor.kl_ctl={0.01 if args.ref else 0.0}",
    ]
    config, _ = load_expr_config(
        ["--config", os.path.join(ROOT, "examples/math/gsm8k_grpo_cpu.yaml"), *overrides],
        GRPOConfig,
    )
    config.actor.path = os.path.join(ROOT, config.actor.path)
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=100_000, train_batch_size=16)
    batches = {"demo": make_batch(128, 96, (40, 56), 40, seed=0)}
    if not args.skip_large:
        batches["large"] = make_batch(512, 1024, (256, 512), 512, seed=1)
    out: dict = {"config": "examples/math/gsm8k_grpo_cpu.yaml", "roles": ["actor"]}
    with LocalScheduler(fileroot=root, experiment_name="bench", trial_name="bt") as sched:
        start = dict(alloc_mode=None, ft_spec=ft_spec, seed=config.seed, world_size=1)
        actor = start_train_controller(ACTOR, config.actor, sched, "actor", group_size=8, **start)
        ref = None
        if args.ref:
            ref_config = copy.deepcopy(config.ref or config.actor)
            ref_config.path = config.actor.path
            ref = start_train_controller(ACTOR, ref_config, sched, "ref", **start)
            out["roles"].append("ref")
        roles = PPORoles(actor, ref=ref)
        transfer = None
        if args.large_engine == "transfer" and not args.skip_large:
            transfer = start_train_controller(
                TRANSFER_ONLY, None, sched, "transfer", group_size=8, **start
            )
        try:
            measure(roles, config, batches["demo"], True, 1)  # warm-up
            for name, batch in batches.items():
                steps = args.steps if name == "demo" else args.large_steps
                res = {
                    "shape": list(batch["attention_mask"].shape),
                    "batch_bytes": nbytes(batch),
                    "tokens": int(batch["attention_mask"].sum()),
                }
                run_roles = roles
                if name == "large" and args.large_engine == "transfer":
                    run_roles = PPORoles(transfer)
                res["engine"] = "FSDPPPOActor" if run_roles is roles else "TransferOnlyActor"
                res["before"] = measure(run_roles, config, batch, False, steps)
                res["after"] = measure(run_roles, config, batch, True, steps)
                b, a = res["before"], res["after"]
                if run_roles is not roles:  # the step's compute from the demo's s/token
                    demo = out["demo"]
                    per_token = demo["after"]["step_s"] / demo["tokens"]
                    for r in (b, a):
                        r["step_s"] = per_token * res["tokens"] + r["transfer_s_per_step"]
                        r["step_s_source"] = "demo s/token x tokens + this transfer"
                        r["transfer_fraction"] = r["transfer_s_per_step"] / r["step_s"]
                res["bytes_ratio_before_over_after"] = b["bytes_per_step"] / a["bytes_per_step"]
                res["transfer_s_ratio_before_over_after"] = b["transfer_s_per_step"] / max(
                    a["transfer_s_per_step"], 1e-9
                )
                out[name] = res
                print(json.dumps({name: res}), file=sys.stderr, flush=True)
        finally:
            for c in (transfer, ref, actor):
                if c is not None:
                    c.destroy()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
