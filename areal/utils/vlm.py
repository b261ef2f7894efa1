"""Vision-language helpers: image decoding/encoding and a light Qwen2-VL processor.

- :func:`load_image` / :func:`load_images`: a PIL image from a PIL image, raw bytes, a
  ``{"bytes": ..., "path": ...}`` dict (the ``datasets`` Image encoding), a data URL, a
  base64 string or a file path; always RGB.
- :func:`image_to_data_url` / :func:`image_to_base64`: PNG base64 for HTTP requests (the
  OpenAI ``image_url`` format vLLM documents; SGLang's ``image_data`` takes the same).
- :class:`QwenVLProcessor`: what ``Qwen2VLProcessor`` does for images (chat template,
  ``<|image_pad|>`` expansion to the number of merged patches, ``pixel_values`` and
  ``image_grid_thw``), built from a tokenizer and a ``Qwen2VLImageProcessor``. Used when
  ``AutoProcessor`` cannot build the real one (transformers 5.24 without torchvision
  fails in the class check of its processor base), and by the tiny VLM.
- :func:`is_qwen_vl_config`: whether a model config is of the Qwen2-VL family.
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# What a chat template writes for one image in the Qwen2-VL family.
QWEN_IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_qwen_vl_config(config: Any) -> bool:
    """Whether ``config`` (a ``PretrainedConfig``) is Qwen2-VL / Qwen2.5-VL."""
    return getattr(config, "model_type", None) in QWEN_VL_MODEL_TYPES


def load_image(image: Any):
    """A PIL RGB image from PIL / bytes / ``{"bytes"|"path"}`` / data URL / base64 / path."""
    from PIL import Image

    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, bytes | bytearray):
        img = Image.open(io.BytesIO(bytes(image)))
    elif isinstance(image, dict):
        if image.get("bytes") is not None:
            img = Image.open(io.BytesIO(image["bytes"]))
        elif image.get("path"):
            img = Image.open(image["path"])
        else:
            raise ValueError(f"image dict has neither 'bytes' nor 'path': keys {sorted(image)}")
    elif isinstance(image, str):
        if image.startswith("data:"):
            _, _, payload = image.partition(",")
            img = Image.open(io.BytesIO(base64.b64decode(payload)))
        elif os.path.exists(image):
            img = Image.open(image)
        else:
            try:
                raw = base64.b64decode(image, validate=True)
            except ValueError as e:
                raise ValueError(
                    f"image string is neither a data URL, an existing file nor base64 "
                    f"(starts {image[:32]!r})"
                ) from e
            img = Image.open(io.BytesIO(raw))
    else:
        raise TypeError(f"cannot read an image from {type(image).__name__}")
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def load_images(images: Any) -> list:
    """:func:`load_image` over a list (``None`` -> ``[]``; one image -> a list of one)."""
    if images is None:
        return []
    if not isinstance(images, list | tuple):
        images = [images]
    return [load_image(im) for im in images]


def image_to_base64(image: Any) -> str:
    """PNG bytes of an image, base64 encoded (no data-URL prefix)."""
    buf = io.BytesIO()
    load_image(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_to_data_url(image: Any) -> str:
    """``data:image/png;base64,...`` of an image."""
    return "data:image/png;base64," + image_to_base64(image)


class QwenVLProcessor:
    """A Qwen2-VL processor for images: tokenizer + image processor + chat template.

    ``processor(text=[...], images=[...], return_tensors="pt")`` returns ``input_ids``,
    ``attention_mask``, ``mm_token_type_ids`` (1 on image tokens), ``pixel_values`` (``[sum of patches, C*T*P*P]``) and
    ``image_grid_thw`` (``[n_images, 3]``), expanding each ``<|image_pad|>`` into
    ``t*h*w / merge_size**2`` pad tokens, as ``Qwen2VLProcessor`` does. Images are consumed
    in order across the texts of the batch.
    """

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = IMAGE_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {IMAGE_PAD!r} token")

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Any = None) -> QwenVLProcessor:
        """Tokenizer + ``Qwen2VLImageProcessor`` (PIL backend) saved in ``path``."""
        import json

        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        cfg_file = os.path.join(path, "preprocessor_config.json")
        if not os.path.exists(cfg_file):
            raise FileNotFoundError(f"{path}: no preprocessor_config.json (not a VLM directory)")
        with open(cfg_file) as f:
            cfg = json.load(f)
        keys = (
            "min_pixels",
            "max_pixels",
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
        )
        kwargs = {k: cfg[k] for k in keys if k in cfg}
        if "size" in cfg and isinstance(cfg["size"], dict) and "min_pixels" not in kwargs:
            kwargs["size"] = cfg["size"]
        image_processor = Qwen2VLImageProcessorPil(**kwargs)
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        return cls(image_processor, tok)

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 2))

    def apply_chat_template(self, messages: list[dict], **kwargs: Any):
        kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(
        self, text: Any = None, images: Any = None, return_tensors: str | None = "pt", **_: Any
    ) -> dict[str, Any]:
        import torch

        texts = [text] if isinstance(text, str) else list(text or [])
        imgs = load_images(images)
        out: dict[str, Any] = {}
        n_tokens: list[int] = []
        if imgs:
            feats = self.image_processor(images=imgs, return_tensors="pt")
            out["pixel_values"] = feats["pixel_values"]
            out["image_grid_thw"] = feats["image_grid_thw"]
            n_tokens = (feats["image_grid_thw"].prod(-1) // self.merge_size**2).tolist()
        expanded, k = [], 0
        for t in texts:
            parts = t.split(IMAGE_PAD)
            if k + len(parts) - 1 > len(n_tokens):
                raise ValueError(
                    f"the texts hold more {IMAGE_PAD} placeholders than the {len(imgs)} images"
                )
            pieces = [parts[0]]
            for p in parts[1:]:
                pieces.append(IMAGE_PAD * int(n_tokens[k]) + p)
                k += 1
            expanded.append("".join(pieces))
        if k != len(n_tokens):
            raise ValueError(f"{len(imgs)} images but {k} {IMAGE_PAD} placeholders in the texts")
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in expanded]
        if return_tensors == "pt":
            width = max((len(x) for x in ids), default=0)
            pad = self.tokenizer.pad_token_id or 0
            input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
            attn = torch.zeros((len(ids), width), dtype=torch.long)
            for i, x in enumerate(ids):
                input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
                attn[i, : len(x)] = 1
            out["input_ids"], out["attention_mask"] = input_ids, attn
            # text 0, image 1 (what transformers' M-RoPE index needs)
            out["mm_token_type_ids"] = (input_ids == self.image_token_id).to(torch.int32)
        else:
            out["input_ids"] = ids
            out["attention_mask"] = [[1] * len(x) for x in ids]
        return out


def load_vlm_processor(path: str, tokenizer: Any = None) -> Any:
    """``AutoProcessor.from_pretrained(path)``, else :class:`QwenVLProcessor` for the dir."""
    try:
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(path)
        if hasattr(proc, "image_processor"):
            return proc
    except Exception:  # noqa: BLE001 - fall back to the light processor below
        pass
    return QwenVLProcessor.from_pretrained(path, tokenizer=tokenizer)
