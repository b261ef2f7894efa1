"""LoRA adapters as files and as weight deltas, shared by training and serving (``peft``'s
layout: ``adapter_model.safetensors`` + ``adapter_config.json``).

The training engine writes an adapter (:func:`write_adapter`, from :func:`adapter_tensors`
of its peft model; ``areal.engine.lora``); the built-in server applies one by merging it
into its base weights (:func:`apply_adapter`), keeping a copy of the original weights
``W0`` of every targeted module so that each new adapter version replaces the previous
one (``W = W0 + s B A``). vLLM loads it with ``/v1/load_lora_adapter``
(``areal.inference.clients.vllm``).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from areal.utils import logging

logger = logging.getLogger("LoRA")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def lora_scale(rank: int, alpha: float) -> float:
    return float(alpha) / float(rank)


def hf_name(peft_name: str) -> str:
    """peft parameter name -> the base model's HF name."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


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
