"""``VisionRLVRWorkflow``: RL with verifiable rewards on image + text prompts.

One episode (one call of ``arun_episode``), as :class:`~areal.workflow.rlvr.RLVRWorkflow`
but multimodal:

1. the processor renders the row's ``messages`` (user ``content`` with ``{"type": "image"}``
   parts, see :mod:`areal.dataset.vision`; a pre-rendered string is used as is) with the
   chat template, then turns text + ``images`` into ``input_ids`` (each image placeholder
   expanded to its pad tokens), ``pixel_values`` and ``image_grid_thw``; the samples of
   one prompt (run concurrently by the trainer) share ONE encoding, tensors included
   (keyed by the text and the images' pixels; the batch then pickles each image once);
2. one generation request carrying the images (``ModelRequest.image_data``: base64 PNG,
   one per image) and the chat messages with ``image_url`` parts
   (``vision_msg_vllm``, for backends that take images through chat completions);
3. the completion is scored by ``reward_fn`` (every data field but ``images`` and
   ``messages`` passed as keyword arguments, e.g. ``answer``);
4. the result is a padded batch of ONE row with RLVRWorkflow's keys (``input_ids``,
   ``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``, ``rewards``, ``seqlen``,
   ``no_eos``) plus ``multi_modal_input``: a list of one dict ``{"pixel_values",
   "image_grid_thw"}`` that :class:`~areal.engine.fsdp_engine.FSDPEngine` feeds to the
   vision tower (batches concatenate these lists row by row).

Images in a row may be bytes, PIL images, ``{"bytes", "path"}`` dicts, base64 strings or
paths (:func:`areal.utils.vlm.load_image`).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from areal.api.io_struct import ModelRequest
from areal.infra.rollout import workflow_context
from areal.utils import logging
from areal.utils.seeding import request_seed
from areal.utils.vlm import image_to_base64, load_images
from areal.workflow.rlvr import RLVRWorkflow
from areal.workflow.trajectory import single_turn_trajectory

if TYPE_CHECKING:
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.engine_api import InferenceEngine

logger = logging.getLogger("VisionRLVRWorkflow")

# Data fields not forwarded to the reward function (big, and not what rewards read).
_NOT_FOR_REWARD = ("prompt", "completions", "prompt_ids", "completion_ids", "images", "messages")
# Encodings kept for the samples of the prompts in flight (a group's samples share one).
_ENCODING_CACHE_SIZE = 128


def _encoding_key(text: str, images: list) -> str:
    """The text and every image's mode, size and pixels, hashed."""
    h = hashlib.blake2b(text.encode(), digest_size=16)
    for im in images:
        h.update(f"|{im.mode}|{im.size}|".encode())
        h.update(im.tobytes())
    return h.hexdigest()


def _load_processor(path: str, tokenizer: Any = None) -> Any:
    from areal.utils.vlm import load_vlm_processor

    return load_vlm_processor(path, tokenizer=tokenizer)


def _chat_messages(messages: Any) -> list[dict] | None:
    """The messages with ``image`` parts turned into ``image_url`` parts (urls filled later)."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") in ("image", "image_url"):
                    parts.append({"type": "image_url", "image_url": {"url": ""}})
                else:
                    parts.append({"type": "text", "text": p.get("text") or ""})
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


class VisionRLVRWorkflow(RLVRWorkflow):
    """Sample one answer to an image question and score it with ``reward_fn``.

    Args:
        reward_fn: ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)``
            (module-level) or its import string
            (``"areal.reward.clevr_count_70k.clevr_count_70k_reward_fn"``).
        gconfig: sampling parameters (groups are formed by the trainer).
        tokenizer: tokenizer object or path.
        processor: the model's processor (``AutoProcessor``; or a path to load one, with
            :class:`areal.utils.vlm.QwenVLProcessor` as the fallback).
        enable_thinking: forwarded to the chat template.
        reward_timeout_seconds: wall-clock limit of one reward call (process pool).
        Other keyword arguments are RLVRWorkflow's (``rollout_stat_scope``, ``dump_dir``, ...).
    """

    def __init__(
        self,
        reward_fn: Callable[..., float] | str,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        processor: Any,
        enable_thinking: bool = False,
        reward_timeout_seconds: float = 60.0,
        **kwargs: Any,
    ):
        from areal.api.reward_api import AsyncRewardWrapper

        super().__init__(reward_fn, gconfig, tokenizer, enable_thinking, **kwargs)
        # A spawned reward worker imports the caller's main module first; on a loaded
        # machine that can exceed RLVRWorkflow's 15 s default and break the pool.
        self.async_reward_fn = AsyncRewardWrapper(
            self.reward_fn, timeout_seconds=reward_timeout_seconds
        )
        if processor is None:
            raise ValueError("VisionRLVRWorkflow: processor (object or path) is required")
        if isinstance(processor, str):
            processor = _load_processor(processor, self.tokenizer)
        self.processor = processor
        self._encodings: OrderedDict[str, asyncio.Future] = OrderedDict()
        self._encodings_loop: asyncio.AbstractEventLoop | None = None

    def _encode_sync(self, text: str, images: list) -> dict[str, Any]:
        enc = self.processor(text=[text], images=images, return_tensors="pt")
        return {
            "input_ids": [int(t) for t in enc["input_ids"][0].tolist()],
            "pixel_values": enc["pixel_values"],
            "image_grid_thw": enc["image_grid_thw"],
            "image_data": [image_to_base64(im) for im in images],
        }

    async def _encode(self, text: str, images: list) -> dict[str, Any]:
        """The processor's output for (text, images), computed once for concurrent and
        repeated calls (image decoding / preprocessing runs off the event loop)."""
        loop = asyncio.get_running_loop()
        if self._encodings_loop is not loop:  # futures belong to one loop
            self._encodings.clear()
            self._encodings_loop = loop
        key = _encoding_key(text, images)
        fut = self._encodings.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self._encode_sync, text, images))
            self._encodings[key] = fut
            while len(self._encodings) > _ENCODING_CACHE_SIZE:
                self._encodings.popitem(last=False)
        else:
            self._encodings.move_to_end(key)
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if fut.done() and self._encodings.get(key) is fut:
                del self._encodings[key]  # a failed encoding is not kept
            raise

    def _render(self, data: dict[str, Any]) -> str:
        messages = self.data_extract_prompt_fn(data)
        if isinstance(messages, str):
            return messages
        kwargs: dict[str, Any] = dict(tokenize=False, add_generation_prompt=True)
        if self.enable_thinking:
            kwargs["enable_thinking"] = True
        return self.processor.apply_chat_template(messages, **kwargs)

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> dict[str, Any] | None:
        if "images" not in data:
            raise KeyError(f"VisionRLVRWorkflow: data has no 'images' field (keys: {sorted(data)})")
        images = load_images(data["images"])
        text = self._render(data)
        enc = await self._encode(text, images)
        input_ids = list(enc["input_ids"])
        image_data = list(enc["image_data"])
        ctx = workflow_context.get()
        version = engine.get_version() if hasattr(engine, "get_version") else 0
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(input_ids),
            gconfig=self.gconfig,
            tokenizer=self.tokenizer,
            metadata={"seed": request_seed(*workflow_context.seed_parts(input_ids, version))},
            image_data=image_data,
            vision_msg_vllm=_chat_messages(self.data_extract_prompt_fn(data)),
            processor=self.processor,
        )
        resp = await engine.agenerate(req)

        skip = self.gconfig.skip_special_tokens
        prompt_str = self.tokenizer.decode(input_ids, skip_special_tokens=skip)
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=skip)
        reward_kwargs = {k: v for k, v in data.items() if k not in _NOT_FOR_REWARD}
        reward = await self.async_reward_fn(
            prompt_str, completion, list(input_ids), list(resp.output_tokens), **reward_kwargs
        )
        batch = single_turn_trajectory(input_ids, resp, reward, owner="VisionRLVRWorkflow")
        p_len, c_len = len(input_ids), resp.output_len
        batch["multi_modal_input"] = [
            {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
        ]
        self._record_stats(float(reward), p_len, c_len, resp.stop_reason == "length")
        if self.dump_dir is not None:
            await self._dump(engine, data, prompt_str, completion, float(reward), resp, ctx)
        return batch
