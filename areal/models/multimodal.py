"""Vision-language models in the training engine (Qwen2-VL / Qwen2.5-VL family).

Batches carry one ``multi_modal_input`` entry per sequence (a list aligned with the rows):
a dict with ``pixel_values`` (``[n_patches, C*T*P*P]``) and ``image_grid_thw``
(``[n_images, 3]``) for a sequence with images, ``{}`` for a text-only one. The packed
micro-batch keeps that list in row order; :func:`packed_multimodal_kwargs` turns it into
the model's inputs:

- ``pixel_values`` / ``image_grid_thw``: the entries concatenated in sequence order (the
  model scatters the image features onto the ``<|image_pad|>`` tokens in the same order);
- ``position_ids`` ``[3, 1, N]``: M-RoPE positions computed per sequence with the model's
  own ``get_rope_index`` (temporal/height/width for image tokens, text positions after
  them continue from the largest image position), text-only sequences get ``arange`` in
  all three rows. Sequences never see each other: attention is varlen over ``cu_seqlens``.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.utils.vlm import is_qwen_vl_config

MM_KEY = "multi_modal_input"

__all__ = [
    "MM_KEY",
    "freeze_vision_tower",
    "has_images",
    "is_qwen_vl_config",
    "model_class_for",
    "packed_multimodal_kwargs",
]


def model_class_for(hf_config: Any):
    """The transformers class that loads a Qwen2-VL-family checkpoint."""
    if hf_config.model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration


def vision_tower(model: Any):
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or getattr(model, "visual", None)


def freeze_vision_tower(model: Any) -> int:
    """``requires_grad=False`` on the vision tower; returns the number of frozen parameters."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"{type(model).__name__} has no vision tower ('visual') to freeze")
    n = 0
    for p in tower.parameters():
        p.requires_grad_(False)
        n += p.numel()
    return n


def use_sdpa_in_vision_tower(model: Any) -> None:
    """The vision tower attends bidirectionally within each image: give it plain SDPA
    (the engine's packed-text attention is causal)."""
    vc = getattr(model.config, "vision_config", None)
    if vc is not None:
        vc._attn_implementation = "sdpa"
    tower = vision_tower(model)
    if tower is not None and getattr(tower, "config", None) is not None:
        tower.config._attn_implementation = "sdpa"


def has_images(entries: Any) -> bool:
    return isinstance(entries, list) and any(
        isinstance(e, dict) and e.get("pixel_values") is not None for e in entries
    )


def _rope_model(model: Any):
    inner = getattr(model, "model", model)
    if hasattr(inner, "get_rope_index"):
        return inner
    if hasattr(model, "get_rope_index"):
        return model
    raise ValueError(f"{type(model).__name__} has no get_rope_index (not a Qwen2-VL model)")


def packed_multimodal_kwargs(
    model: Any, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, entries: list[dict]
) -> dict[str, Any]:
    """``position_ids`` (``[3, 1, N]``), ``pixel_values``, ``image_grid_thw`` of a packed
    micro-batch (``input_ids`` ``[N]``, ``cu_seqlens`` ``[B+1]``, ``entries`` one per row)."""
    bounds = cu_seqlens.tolist()
    if len(entries) != len(bounds) - 1:
        raise ValueError(
            f"{MM_KEY} has {len(entries)} entries for {len(bounds) - 1} sequences in the "
            "micro-batch (one dict per sequence, {} for text-only rows)"
        )
    rope = _rope_model(model)
    image_token_id = model.config.image_token_id
    positions, pixels, grids = [], [], []
    for (s, e), entry in zip(zip(bounds[:-1], bounds[1:], strict=True), entries, strict=True):
        ids = input_ids[s:e]
        pv = entry.get("pixel_values") if isinstance(entry, dict) else None
        if pv is None:
            positions.append(torch.arange(e - s, device=ids.device).view(1, 1, -1).expand(3, 1, -1))
            continue
        grid = torch.as_tensor(entry["image_grid_thw"], device=ids.device).long().view(-1, 3)
        mm_types = (ids == image_token_id).to(torch.int32)[None]
        pos, _ = rope.get_rope_index(ids[None], mm_token_type_ids=mm_types, image_grid_thw=grid)
        positions.append(pos)
        pixels.append(torch.as_tensor(pv, device=ids.device))
        grids.append(grid)
    out: dict[str, Any] = {"position_ids": torch.cat(positions, dim=2)}
    if pixels:
        out["pixel_values"] = torch.cat(pixels, dim=0)
        out["image_grid_thw"] = torch.cat(grids, dim=0)
    return out
