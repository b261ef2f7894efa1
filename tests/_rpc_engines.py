"""Engines hosted by RPC workers in the scheduler/RPC/controller tests (importable module)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


class EchoEngine:
    """No torch.distributed: arithmetic, failures and process facts."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) * self.scale

    def fail(self, msg: str = "boom") -> None:
        raise ValueError(f"engine failure: {msg}")

    def pid(self) -> int:
        return os.getpid()

    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def num_threads(self) -> int:
        return torch.get_num_threads()


class DistTestEngine:
    """Uses a real gloo process group built from RANK/WORLD_SIZE/MASTER_* env vars."""

    def __init__(self, config=None):
        self.config = config
        self.version = 0
        self.saved: list[str] = []

    def initialize(self, addr=None, ft_spec=None, **kwargs) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
        self.ft_spec = ft_spec
        self.init_kwargs = kwargs

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def rank_of_each_sequence(self, batch: dict) -> torch.Tensor:
        """[b] tensor: the rank that received each sequence."""
        return torch.full((batch["input_ids"].shape[0],), dist.get_rank(), dtype=torch.long)

    def forward_batch(self, input_: dict, **kwargs) -> torch.Tensor:
        """[b, T]: input_ids * 2 (masked), after an all_reduce of the local token count."""
        n = input_["attention_mask"].sum().reshape(1).float()
        dist.all_reduce(n)
        self.last_total_tokens = float(n)
        return input_["input_ids"].float() * 2 * input_["attention_mask"]

    def train_batch(self, input_: dict, loss_fn=None, loss_weight_fn=None) -> dict:
        n = input_["attention_mask"].sum().reshape(1).float()
        local = float(n)
        dist.all_reduce(n)
        return {"total_tokens": float(n), "local_tokens": local, "rank": dist.get_rank()}

    def compute_advantages(self, batch: dict) -> dict:
        out = dict(batch)
        r = batch["rewards"].float()
        tot = torch.stack([r.sum(), torch.tensor(float(r.numel()))])
        dist.all_reduce(tot)  # batch-level mean over all ranks, like PPOActor's norms
        out["advantages"] = (r - tot[0] / tot[1]).unsqueeze(1) * batch["attention_mask"]
        out["adv_rank"] = dist.get_rank()
        return out

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def save(self, meta) -> None:
        if dist.get_rank() == 0:
            os.makedirs(meta.path, exist_ok=True)
            with open(os.path.join(meta.path, "model.txt"), "w") as f:
                f.write(f"version={self.version}")
        dist.barrier()

    def world(self) -> int:
        t = torch.ones(1)
        dist.all_reduce(t)
        return int(t)

    def connect_engine(self, engine, meta) -> None:
        self.connected = (engine, meta)


# Loss functions for the FSDPEngine controller test (must be importable by workers).
def sft_loss_fn(logp, entropy, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum()


def sft_loss_weight_fn(d):
    return d["loss_mask"].sum()
