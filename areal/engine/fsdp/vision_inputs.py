"""The images of a packed VLM micro-batch, each through the vision tower once.

GRPO's samples of one prompt carry the same image (one processor output per sample, equal
pixels), so the engine's fast VLM path (``FSDPEngine.dedup_images``):

1. :func:`pack_images` finds the distinct images of the micro-batch (grid and pixels
   equal), gives every image token the row of its feature among those images' features,
   computes the M-RoPE ``position_ids`` (the model's own ``get_rope_index``, once per
   distinct prompt-with-images; the text after the last image continues one position per
   token, as ``get_rope_index`` does), and gives every token a *key*: its id for text, a
   per-image id for image tokens, so that sequences share a leading run of keys only
   where they share tokens AND images (the engine's shared-prefix plan reads the keys);
2. :class:`VisionFeatureInjector`, a forward pre-hook of the language model, runs the
   vision tower on the distinct images inside the model's forward and puts each image
   token's feature row on its embedding (what the model's own ``masked_scatter`` does
   with every sample's copy). Gradients of an image's copies add up in the one feature
   row they read (autograd through ``index_select``), so the result equals running every
   copy (up to float summation order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PackedImages", "VisionFeatureInjector", "language_model_of", "pack_images"]


@dataclass
class PackedImages:
    """What :func:`pack_images` found in a packed micro-batch of ``N`` tokens.

    ``position_ids`` ``[3, 1, N]``; ``pixel_values`` / ``image_grid_thw`` of the distinct
    images (None when the micro-batch has no image); ``token_rows`` ``[N]``: the row of an
    image token's feature in the distinct images' concatenated merged features, -1 on
    text; ``keys`` ``[N]``: token id on text, ``base + image index`` on image tokens.
    """

    position_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    token_rows: torch.Tensor
    keys: torch.Tensor


def _rope_model(model: Any):
    inner = getattr(model, "model", model)
    if hasattr(inner, "get_rope_index"):
        return inner
    if hasattr(model, "get_rope_index"):
        return model
    raise ValueError(f"{type(model).__name__} has no get_rope_index (not a Qwen2-VL model)")


def language_model_of(model: Any):
    """The text decoder stack of a Qwen2-VL-family model (its input is ``inputs_embeds``)."""
    inner = getattr(model, "model", model)
    lm = getattr(inner, "language_model", None)
    if lm is None:
        raise ValueError(f"{type(model).__name__} has no language_model (not a Qwen2-VL model)")
    return lm


class _ImageTable:
    """Distinct images by (grid, pixels): the first copy of each keeps an index."""

    def __init__(self, merge: int):
        self.merge2 = merge * merge
        self.pixels: list[torch.Tensor] = []
        self.grids: list[torch.Tensor] = []
        self.offsets: list[int] = []  # first merged-feature row of each distinct image
        self.n_rows = 0
        self._by_fingerprint: dict[tuple, list[int]] = {}

    def index_of(self, pixels: torch.Tensor, grid: torch.Tensor) -> int:
        fp = (tuple(grid.tolist()), tuple(pixels.shape), float(pixels.sum(dtype=torch.float64)))
        for i in self._by_fingerprint.get(fp, ()):
            if torch.equal(self.pixels[i], pixels):
                return i
        i = len(self.pixels)
        self._by_fingerprint.setdefault(fp, []).append(i)
        self.pixels.append(pixels)
        self.grids.append(grid)
        self.offsets.append(self.n_rows)
        self.n_rows += int(grid.prod()) // self.merge2
        return i


def pack_images(
    model: Any, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, entries: list[dict]
) -> PackedImages:
    """Distinct images, feature rows, M-RoPE positions and keys of a packed micro-batch
    (``input_ids`` ``[N]``, ``cu_seqlens`` ``[B+1]``, ``entries`` one per row: a dict with
    ``pixel_values`` / ``image_grid_thw``, or ``{}`` for a text-only row)."""
    bounds = cu_seqlens.tolist()
    if len(entries) != len(bounds) - 1:
        raise ValueError(
            f"multi_modal_input has {len(entries)} entries for {len(bounds) - 1} sequences in "
            "the micro-batch (one dict per sequence, {} for text-only rows)"
        )
    rope = _rope_model(model)
    image_token_id = int(model.config.image_token_id)
    merge = int(model.config.vision_config.spatial_merge_size)
    dev = input_ids.device
    n = input_ids.numel()
    table = _ImageTable(merge)
    positions = torch.empty(3, 1, n, dtype=torch.long, device=dev)
    token_rows = torch.full((n,), -1, dtype=torch.long)
    image_of_token = torch.full((n,), -1, dtype=torch.long)
    # (ids up to the last image token, grids) -> (its positions, position of the next token)
    rope_cache: dict[tuple[bytes, bytes], tuple[torch.Tensor, int | None]] = {}
    is_image = (input_ids == image_token_id).cpu()
    for row, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        entry = entries[row]
        pv = entry.get("pixel_values") if isinstance(entry, dict) else None
        if pv is None:
            positions[:, 0, s:e] = torch.arange(e - s, device=dev)
            continue
        pv = torch.as_tensor(pv)
        grid = torch.as_tensor(entry["image_grid_thw"]).long().view(-1, 3).cpu()
        img_pos = torch.nonzero(is_image[s:e])[:, 0]
        n_tokens = (grid.prod(-1) // (merge * merge)).tolist()
        if img_pos.numel() != sum(n_tokens):
            raise ValueError(
                f"row {row} of the micro-batch has {img_pos.numel()} image tokens but its "
                f"image_grid_thw {grid.tolist()} makes {sum(n_tokens)} image features"
            )
        rows, owners = [], []
        for pixels, g, k in zip(
            torch.split(pv, grid.prod(-1).tolist(), dim=0), grid, n_tokens, strict=True
        ):
            i = table.index_of(pixels, g)
            rows.append(torch.arange(table.offsets[i], table.offsets[i] + k))
            owners.append(torch.full((k,), i, dtype=torch.long))
        token_rows[s + img_pos] = torch.cat(rows)
        image_of_token[s + img_pos] = torch.cat(owners)
        ids = input_ids[s:e]
        head = int(img_pos[-1]) + 1  # tokens up to the last image's last token
        key = (ids[:head].cpu().numpy().tobytes(), grid.numpy().tobytes())
        hit = rope_cache.get(key)
        if hit is None or (hit[1] is None and head < e - s):
            mm_types = is_image[s:e].to(device=dev, dtype=torch.int32)[None]
            pos, _ = rope.get_rope_index(
                ids[None], mm_token_type_ids=mm_types, image_grid_thw=grid.to(dev)
            )
            pos = pos[:, 0]
            positions[:, 0, s:e] = pos
            rope_cache[key] = (pos[:, :head], int(pos[0, head]) if head < e - s else None)
            continue
        positions[:, 0, s : s + head] = hit[0]
        if head < e - s:  # text after the last image: one position per token (all 3 rows)
            positions[:, 0, s + head : e] = hit[1] + torch.arange(e - s - head, device=dev)
    keys = input_ids.clone()
    if table.pixels:
        base = int(input_ids.max()) + 1
        m = image_of_token >= 0
        keys[m.to(dev)] = (base + image_of_token[m]).to(dev)
    return PackedImages(
        position_ids=positions,
        pixel_values=torch.cat(table.pixels).to(dev) if table.pixels else None,
        image_grid_thw=torch.stack(table.grids).to(dev) if table.grids else None,
        token_rows=token_rows.to(dev),
        keys=keys,
    )


class VisionFeatureInjector:
    """Forward pre-hook (``with_kwargs``) of the language model: with a pending request,
    run the vision tower on the request's images and put feature row ``rows[k]`` on the
    ``inputs_embeds`` position ``where[k]``. Without one it changes nothing."""

    def __init__(self, tower: Any):
        self.tower = tower
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def request(
        self,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        token_rows: torch.Tensor | None,
    ) -> None:
        """Images for the next forward: ``token_rows`` ``[N_in]`` per input position (-1 on
        text); None clears the request."""
        if pixel_values is None or token_rows is None:
            self._pending = None
            return
        where = torch.nonzero(token_rows >= 0)[:, 0]
        self._pending = (pixel_values, image_grid_thw, token_rows.index_select(0, where), where)

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._pending is None:
            return None
        pixel_values, grid, rows, where = self._pending
        emb = kwargs.get("inputs_embeds")
        if emb is None or emb.dim() != 3 or emb.shape[0] != 1:
            raise ValueError("VisionFeatureInjector expects inputs_embeds [1, N, hidden]")
        out = self.tower(pixel_values.type(self.tower.dtype), grid_thw=grid)
        feats = getattr(out, "pooler_output", out)
        feats = feats.to(emb.dtype).index_select(0, rows)
        kwargs = dict(kwargs)
        kwargs["inputs_embeds"] = emb[0].index_put((where,), feats)[None]
        return args, kwargs
