"""Request formats for prompts with images, per inference backend.

``RemoteInfEngine`` builds the text-only generate call with the backend adapter, then
:func:`add_images` adds the images the way each server documents it:

- ``local`` (the built-in server) and ``sglang`` (native ``/generate``): ``input_ids``
  already hold the expanded image pad tokens (as the HF processor writes them) and
  ``image_data`` is the list of images, each a base64 string (SGLang's ``image_data``
  accepts base64 strings, URLs or file names, one per image).
- ``vllm``: images go through the OpenAI-compatible ``/v1/chat/completions`` with
  ``image_url`` content parts holding ``data:image/png;base64,...`` URLs (the format vLLM
  documents for multimodal chat); the server renders the chat template itself, so the
  request needs the chat messages (``ModelRequest.vision_msg_vllm``). Sampling parameters
  are carried over from the completions payload; token ids come back as
  ``token_id:N`` strings (``return_tokens_as_token_ids``) and are parsed by
  :func:`parse_chat_completion`. A request interrupted mid-generation (pause for a weight
  update) cannot be resumed from token ids on this path: it is sent again from the
  messages.

These formats are unit-tested on the request/response JSON only; they were not run
against real vLLM or SGLang servers here.
"""

from __future__ import annotations

import copy
from typing import Any

from areal.utils.vlm import image_to_base64, image_to_data_url

# completions fields that chat completions does not take (or takes under another shape)
_NOT_IN_CHAT = ("prompt", "logprobs", "echo", "suffix", "best_of")


def _b64(image: Any) -> str:
    if isinstance(image, str):
        if image.startswith("data:"):
            return image.partition(",")[2]
        return image  # already base64 (or a URL / path the server resolves)
    return image_to_base64(image)


def _data_url(image: Any) -> str:
    if isinstance(image, str):
        if image.startswith(("data:", "http://", "https://", "file:")):
            return image
        return "data:image/png;base64," + image
    return image_to_data_url(image)


def vllm_chat_messages(messages: list[dict], image_data: list[Any]) -> list[dict]:
    """``messages`` with every image part (``image`` / ``image_url``) filled with the images,
    in order, as ``{"type": "image_url", "image_url": {"url": data URL}}``."""
    out = copy.deepcopy(messages)
    k = 0
    for msg in out:
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                if k >= len(image_data):
                    raise ValueError(
                        f"the messages have more image parts than the {len(image_data)} images"
                    )
                content[i] = {"type": "image_url", "image_url": {"url": _data_url(image_data[k])}}
                k += 1
            elif isinstance(part, dict) and part.get("type") == "text":
                content[i] = {"type": "text", "text": part.get("text") or ""}
    if k != len(image_data):
        raise ValueError(f"{len(image_data)} images but {k} image parts in the messages")
    return out


def add_images(backend: str, call: Any, image_data: list[Any], messages: list[dict] | None):
    """The generate call of ``backend`` with the images added (see module docstring)."""
    from areal.infra.remote_inf_engine import HttpCall

    payload = dict(call.payload or {})
    if backend in ("local", "sglang"):
        payload["image_data"] = [_b64(im) for im in image_data]
        return HttpCall(call.path, payload, call.method)
    if backend == "vllm":
        if not messages:
            raise ValueError(
                "vLLM takes images through chat completions: the request needs the chat "
                "messages (ModelRequest.vision_msg_vllm)"
            )
        chat = {k: v for k, v in payload.items() if k not in _NOT_IN_CHAT}
        chat["messages"] = vllm_chat_messages(messages, image_data)
        chat["logprobs"] = True
        chat["top_logprobs"] = 0
        chat["add_generation_prompt"] = True
        return HttpCall("/v1/chat/completions", chat, call.method)
    raise ValueError(f"backend {backend!r} does not take images; use local, sglang or vllm")


def parse_chat_completion(data: dict[str, Any]):
    """A vLLM chat completion (``return_tokens_as_token_ids``) -> ``GenChunk``."""
    from areal.infra.remote_inf_engine import GenChunk, _stop_reason

    c = data["choices"][0]
    content = (c.get("logprobs") or {}).get("content") or []
    if c.get("token_ids") is not None:
        tokens = [int(t) for t in c["token_ids"]]
    else:
        tokens = [int(str(e["token"]).rpartition(":")[2]) for e in content]
    logprobs = [float(e["logprob"]) if e.get("logprob") is not None else 0.0 for e in content]
    return GenChunk(tokens, logprobs, None, _stop_reason(c.get("finish_reason")))
