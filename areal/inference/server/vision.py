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

import asyncio
import hashlib
from collections import OrderedDict
from typing import Any

import torch

from areal.inference.server.requests import RequestError


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


def _content_key(image_data: Any) -> str | None:
    """A digest of inline images (base64 / data URLs); ``None`` when any entry is a path or
    a URL, whose content could change between requests."""
    if not isinstance(image_data, list) or not image_data:
        return None
    h = hashlib.blake2b(digest_size=16)
    for item in image_data:
        if not isinstance(item, str) or not (item.startswith("data:") or len(item) > 512):
            return None
        if "://" in item[:16]:
            return None
        h.update(item.encode())
        h.update(b"\0")
    return h.hexdigest()


class ImageInputCache:
    """Preprocessed inputs of the last ``size`` distinct inline image lists.

    A GRPO group sends the same image with each of its ``n`` samples, as ``n`` requests
    that arrive together: the first starts the decode + preprocess in a worker thread,
    the others await the same task (shielded, so a cancelled request does not cancel it
    for the rest). A failed task is dropped, so a later request tries again.
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._tasks: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.hits = 0
        self.misses = 0

    async def get(self, image_processor: Any, image_data: Any) -> dict[str, Any]:
        key = _content_key(image_data)
        if key is None:
            self.misses += 1
            return await asyncio.to_thread(images_to_mm_inputs, image_processor, image_data)
        task = self._tasks.get(key)
        if task is None:
            self.misses += 1
            task = asyncio.ensure_future(
                asyncio.to_thread(images_to_mm_inputs, image_processor, image_data)
            )
            self._tasks[key] = task
            while len(self._tasks) > self.size:
                self._tasks.popitem(last=False)
        else:
            self.hits += 1
            self._tasks.move_to_end(key)
        try:
            return await asyncio.shield(task)
        except RequestError:
            if self._tasks.get(key) is task:
                del self._tasks[key]
            raise


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
