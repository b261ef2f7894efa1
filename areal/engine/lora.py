"""LoRA on the training engine and the inference servers (``peft``).

Training (``TrainEngineConfig.use_lora``): the HF model is wrapped by ``peft`` (LoRA on
``target_modules`` with rank ``lora_rank`` and ``lora_alpha``) before FSDP2 shards it;
only the adapter is trainable. Exported weights come in two forms:

- merged (:class:`MergedLoRATensor`): full base-model weights under their Hugging Face
  names, ``W = W0 + (lora_alpha / r) * B @ A``; used by HF saves and full weight syncs,
  so a checkpoint loads in plain transformers/vLLM;
- adapter only (``areal.models.lora_adapter.adapter_tensors``): the ``lora_A`` / ``lora_B`` matrices under
  peft's saved names (``base_model.model.<module>.lora_A.weight``), written with an
  ``adapter_config.json`` (``write_adapter``). That is what the adapter-only weight
  sync sends (``WeightUpdateMeta.use_lora``; :class:`LoRASyncHook`).

Serving: the built-in server applies an adapter by merging it into its base weights
(:func:`apply_adapter`), keeping a copy of the original weights ``W0`` of every targeted
module so that each new adapter version replaces the previous one (``W = W0 + s B A``).
vLLM loads it with ``/v1/load_lora_adapter`` (``areal.engine.vllm_remote``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from areal.api.engine_config import TrainEngineConfig
from areal.infra.weights.weight_sync import WeightSyncContext, WeightSyncHook
from areal.models.lora_adapter import hf_name
from areal.utils import logging

logger = logging.getLogger("LoRA")

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def wrap_lora(model: nn.Module, config: TrainEngineConfig) -> nn.Module:
    """``peft`` LoRA around ``model`` (before sharding); only adapter weights train."""
    from peft import LoraConfig, get_peft_model

    targets = list(config.target_modules or []) or DEFAULT_TARGETS
    if targets == ["all-linear"]:
        targets = DEFAULT_TARGETS
    rank = int(config.lora_rank)
    alpha = float(config.lora_alpha)
    if rank < 1:
        raise ValueError(f"TrainEngineConfig.lora_rank={rank}; must be >= 1")
    peft_cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(model, peft_cfg)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA r=%d alpha=%g on %s: %d trainable of %d parameters",
        rank,
        alpha,
        targets,
        n_train,
        n_all,
    )
    return model


class MergedLoRATensor:
    """Stand-in for an exported tensor: ``W0 + scale * B @ A`` computed on ``full_tensor()``
    (each part may be a sharded DTensor; gathering is collective)."""

    def __init__(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = base.shape

    def detach(self) -> MergedLoRATensor:
        return self

    @staticmethod
    def _full(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def full_tensor(self) -> torch.Tensor:
        w0 = self._full(self.base).float()
        a = self._full(self.a).float()
        b = self._full(self.b).float()
        return w0 + self.scale * (b @ a)


def merged_export_tensors(
    named: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor | MergedLoRATensor]:
    """Exported tensors of a peft model under HF names, LoRA merged into targeted weights."""
    out: dict[str, Any] = {}
    for name, t in named.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer.weight" in name:
            module = name[: -len(".base_layer.weight")]
            a = named.get(f"{module}.lora_A.default.weight")
            b = named.get(f"{module}.lora_B.default.weight")
            if a is not None and b is not None:
                out[hf_name(name)] = MergedLoRATensor(t, a, b, scale)
                continue
        out[hf_name(name)] = t
    return out


class LoRASyncHook(WeightSyncHook):
    """Adapter-only weight sync: every sync after the first sends just the adapter, under
    the versioned name ``{lora_name}-v{version}`` (``WeightUpdateMeta.use_lora``).

    ``full_first``: the first sync sends the full merged weights (servers started from a
    different base); default False (servers start from the same base checkpoint).
    """

    def __init__(self, lora_name: str = "areal-lora", full_first: bool = False):
        self.lora_name = lora_name
        self.full_first = full_first
        self._n = 0

    def transform(self, ctx: WeightSyncContext, meta: Any) -> Any:
        import dataclasses

        self._n += 1
        if meta.type != "disk":
            logger.warning(
                "adapter-only sync needs weight_update_mode 'disk'; sending %s", meta.type
            )
            return meta
        if self.full_first and self._n == 1:
            return meta
        return dataclasses.replace(
            meta, use_lora=True, lora_name=f"{self.lora_name}-v{ctx.version}"
        )
