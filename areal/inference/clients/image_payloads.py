"""How one image is written into an inference request, for the backend adapters.

The adapters (``areal.engine.{local,sglang,vllm}_remote``) each own their request format
for prompts with images (``BackendAdapter.with_images``); they share these two encodings:

- :func:`as_base64`: a base64 string (the built-in server's and SGLang's ``image_data``);
  a ``data:`` URL is cut to its payload, another string (base64, URL, file name) is
  passed through for the server to resolve;
- :func:`as_data_url`: a ``data:image/png;base64,...`` URL (vLLM's ``image_url`` parts);
  URLs are passed through, a bare base64 string is prefixed.
"""

from __future__ import annotations

from typing import Any

from areal.utils.vlm import image_to_base64, image_to_data_url

__all__ = ["as_base64", "as_data_url"]


def as_base64(image: Any) -> str:
    if isinstance(image, str):
        if image.startswith("data:"):
            return image.partition(",")[2]
        return image  # already base64 (or a URL / path the server resolves)
    return image_to_base64(image)


def as_data_url(image: Any) -> str:
    if isinstance(image, str):
        if image.startswith(("data:", "http://", "https://", "file:")):
            return image
        return "data:image/png;base64," + image
    return image_to_data_url(image)
