"""LoRA on the training engine and the inference servers (``peft``).

Training (``TrainEngineConfig.use_lora``): the HF model is wrapped by ``peft`` (LoRA on
``target_modules`` with rank ``lora_rank`` and ``lora_alpha``) before FSDP2 shards it;
only the adapter is trainable. Exported weights come in two forms:

- merged (:class:`MergedLoRATensor`): full base-model weights under their Hugging Face
  names, ``W = W0 + (lora_alpha / r) * B @ A``; used by HF saves and full weight syncs,
  so a checkpoint loads in plain transformers/vLLM;
- adapter only (:func:`adapter_tensors`): the ``lora_A`` / ``lora_B`` matrices under
  peft's saved names (``base_model.model.<module>.lora_A.weight``), written with an
  ``adapter_config.json`` (:func:`write_adapter`). That is what the adapter-only weight
  sync sends (``WeightUpdateMeta.use_lora``; :class:`LoRASyncHook`).

Serving: the built-in server applies an adapter by merging it into its base weights
(:func:`apply_adapter`), keeping a copy of the original weights ``W0`` of every targeted
module so that each new adapter version replaces the previous one (``W = W0 + s B A``).
vLLM loads it with ``/v1/load_lora_adapter`` (``areal.engine.vllm_remote``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from areal.api.engine_config import TrainEngineConfig
from areal.infra.weights.weight_sync import WeightSyncContext, WeightSyncHook
from areal.utils import logging

logger = logging.getLogger("LoRA")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_scale(rank: int, alpha: float) -> float:
    return float(alpha) / float(rank)


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


def hf_name(peft_name: str) -> str:
    """peft parameter name -> the base model's HF name."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


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


def adapter_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's parameters under peft's saved names (``.default`` dropped)."""
    return {
        n.replace(".default.", "."): t
        for n, t in named.items()
        if ".lora_A." in n or ".lora_B." in n
    }


def write_adapter(
    path: str, tensors: dict[str, torch.Tensor], rank: int, alpha: float, targets: list[str]
) -> int:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (peft's layout);
    returns the bytes of the weights."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = {
        "peft_type": "LORA",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(cfg, f, indent=1)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_adapter(path: str) -> tuple[dict[str, torch.Tensor], float]:
    """(tensors, scale) of an adapter directory written by :func:`write_adapter` or peft."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    w_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        raise FileNotFoundError(f"{path!r} has no {ADAPTER_CONFIG} / {ADAPTER_WEIGHTS}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("use_rslora"):
        raise ValueError(f"{path}: rsLoRA adapters are not supported")
    return load_file(w_path), lora_scale(int(cfg["r"]), float(cfg["lora_alpha"]))


def adapter_deltas(tensors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``{hf weight name: scale * B @ A}`` of an adapter."""
    deltas: dict[str, torch.Tensor] = {}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = tensors.get(f"{module}.lora_B.weight")
        if b is None:
            raise ValueError(f"adapter has {name} but no {module}.lora_B.weight")
        deltas[hf_name(module) + ".weight"] = scale * (b.float() @ a.float())
    if not deltas:
        raise ValueError("adapter holds no lora_A/lora_B pairs")
    return deltas


@torch.no_grad()
def apply_adapter(model: nn.Module, path: str, base_cache: dict[str, torch.Tensor]) -> int:
    """Merge the adapter at ``path`` into ``model`` in place: ``W = W0 + s B A``, with
    ``W0`` kept in ``base_cache`` (filled on first use) so that adapters replace each
    other. Returns the number of weights changed."""
    tensors, scale = read_adapter(path)
    deltas = adapter_deltas(tensors, scale)
    params = dict(model.named_parameters())
    missing = [n for n in deltas if n not in params]
    if missing:
        raise ValueError(f"adapter targets weights the model does not have, e.g. {missing[:3]}")
    for name, delta in deltas.items():
        p = params[name]
        if tuple(delta.shape) != tuple(p.shape):
            raise ValueError(f"{name}: adapter delta {tuple(delta.shape)} vs {tuple(p.shape)}")
        if name not in base_cache:
            base_cache[name] = p.detach().clone()
        p.copy_((base_cache[name].float() + delta.to(p.device)).to(p.dtype))
    return len(deltas)


def merge_adapter_into_checkpoint(base_dir: str, adapter_dir: str, out_dir: str) -> str:
    """Write a plain HF checkpoint of ``base_dir`` with the adapter merged (``out_dir``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    apply_adapter(model, adapter_dir, {})
    model.save_pretrained(out_dir)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    except Exception as e:  # a tokenizer is optional
        logger.info("no tokenizer copied from %s: %s", base_dir, e)
    return out_dir


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
