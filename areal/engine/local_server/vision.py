"""Vision-language prefill for the built-in server (Qwen2-VL / Qwen2.5-VL family).

A request carries ``input_ids`` with each image's ``<|image_pad|>`` tokens already
expanded (as the HF processor writes them) and ``image_data`` (base64 / data URL / path per
image). The server turns the images into ``pixel_values`` / ``image_grid_thw`` with the
model's image processor; :func:`check_mm_request` checks that the pad-token count matches
the images. At prefill, :func:`prefill_mm_kwargs` computes each row's M-RoPE positions
with the model's ``get_rope_index`` (left padding: the row's tokens sit at the right end),
concatenates the pixel values of the rows that have images (text-only rows share the
batch), and returns the per-row position offset (``rope delta``) that later decode steps
add to the plain token count.
"""

from __future__ import annotations

from typing import Any

import torch

from areal.engine.local_server.requests import RequestError


def _request_error(msg: str) -> Exception:
    return RequestError(msg)


def _inner(model: Any) -> Any:
    return getattr(model, "model", model)


def images_to_mm_inputs(image_processor: Any, image_data: Any) -> dict[str, Any]:
    """``pixel_values`` / ``image_grid_thw`` of a request's ``image_data`` list."""
    from areal.utils.vlm import load_images

    if not isinstance(image_data, list) or not image_data:
        raise _request_error("'image_data' must be a non-empty list of images (base64 / URL)")
    try:
        images = load_images(image_data)
    except Exception as e:  # noqa: BLE001 - any decoding failure is the client's
        raise _request_error(f"could not decode image_data: {e}") from e
    feats = image_processor(images=images, return_tensors="pt")
    return {"pixel_values": feats["pixel_values"], "image_grid_thw": feats["image_grid_thw"]}


def check_mm_request(model: Any, input_ids: list[int], mm: dict[str, Any], is_vlm: bool) -> None:
    """The image pad tokens of ``input_ids`` must match the images' merged patch counts."""
    if not is_vlm:
        raise _request_error("this model takes no images (not a Qwen2-VL-family model)")
    cfg = model.config
    merge = int(cfg.vision_config.spatial_merge_size)
    grid = torch.as_tensor(mm["image_grid_thw"]).view(-1, 3)
    want = int((grid.prod(-1) // merge**2).sum())
    have = sum(1 for t in input_ids if t == cfg.image_token_id)
    if want != have:
        raise _request_error(
            f"input_ids hold {have} image tokens (id {cfg.image_token_id}) but the images need "
            f"{want}: expand each image placeholder with the model's processor"
        )


def prefill_mm_kwargs(
    model: Any, reqs: list, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, Any], torch.Tensor]:
    """Model kwargs (``position_ids`` ``[3, n, P]``, pixel values) and rope deltas ``[n]``."""
    n, width = ids.shape
    pos = torch.zeros(3, n, width, dtype=torch.long, device=ids.device)
    deltas = torch.zeros(n, dtype=torch.long, device=ids.device)
    pixels, grids = [], []
    image_token_id = model.config.image_token_id
    for i, r in enumerate(reqs):
        length = int(mask[i].sum())
        row = ids[i, width - length :]
        if r.mm is None:
            pos[:, i, width - length :] = torch.arange(length, device=ids.device)
            continue
        grid = torch.as_tensor(r.mm["image_grid_thw"], device=ids.device).long().view(-1, 3)
        types = (row == image_token_id).to(torch.int32)[None]
        p, d = _inner(model).get_rope_index(row[None], mm_token_type_ids=types, image_grid_thw=grid)
        pos[:, i, width - length :] = p[:, 0]
        deltas[i] = int(d.view(-1)[0])
        pixels.append(torch.as_tensor(r.mm["pixel_values"]).to(ids.device))
        grids.append(grid)
    extra: dict[str, Any] = {"position_ids": pos}
    if pixels:
        dtype = next(model.parameters()).dtype
        extra["pixel_values"] = torch.cat(pixels).to(dtype)
        extra["image_grid_thw"] = torch.cat(grids)
    return extra, deltas
