"""HTTP application of the built-in inference server (aiohttp).

``LocalInferenceServer`` wraps a ``GenerationCore`` (``core.py``) with the native endpoints
(health, metrics, version, ``/generate``, pause/continue, weight updates); the
OpenAI-compatible endpoints come from ``openai_api.OpenAIRoutes``, the weight and version
endpoints (pending weights, commit, rollback) from ``weight_routes.WeightRoutes``. The full HTTP surface
is documented in ``docs/inference.md``. Start it with ``python -m areal.inference.server``.

Framework: aiohttp (already a dependency of the client). Request bodies are validated by
hand in each handler and errors use one shape (``error_response``); there is no generated
OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from areal.inference.server.openai_api import OpenAIRoutes, error_response
from areal.inference.server.vision import ImageInputCache
from areal.inference.server.weight_routes import WeightRoutes
from areal.utils import logging

logger = logging.getLogger("LocalServer")

_error = error_response

#: Endpoints that change the server's state (weights, versions, pausing, aborts): they
#: require the run secret (``AREAL_RUN_SECRET``) whenever the server was started with one.
CONTROL_PATHS = (
    "/set_version",
    "/abort_request",
    "/pause",
    "/pause_generation",
    "/resume",
    "/continue",
    "/continue_generation",
    "/set_cpu_threads",
    "/update_weights_from_disk",
    "/update_weights_from_delta",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/weights_fingerprint",
    "/commit_weights",
    "/rollback_weights",
)


def _strict_json_loads(text: str) -> Any:
    import json

    def _refuse(token: str) -> Any:
        raise ValueError(f"{token} is not a JSON number")

    return json.loads(text, parse_constant=_refuse)


def resolve_device(device: str) -> Any:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else as given (validated)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return dev


class LocalInferenceServer(OpenAIRoutes, WeightRoutes):
    """Wraps a ``GenerationCore`` with the HTTP endpoints; build with ``from_pretrained``."""

    def __init__(
        self, core, tokenizer=None, model_path: str = "", served_model_name: str | None = None
    ):
        self.core = core
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.model_name = served_model_name or model_path
        self.groups: dict[str, Any] = {}
        self.image_cache = ImageInputCache()

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        dtype: str = "float32",
        max_batch_size: int = 128,
        max_prefill_tokens: int = 4096,
        context_length: int | None = None,
        seed: int | None = None,
        version: int = 0,
        device: str = "auto",
    ) -> LocalInferenceServer:
        """Load ``model_path`` onto ``device`` (``auto``: CUDA when available, else CPU)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from areal.inference.server.core import GenerationCore
        from areal.utils.hf_utils import resolve_model_path

        # a hub id -> its snapshot in the HF cache (downloaded when the hub is reachable), so
        # the tokenizer files are found beside the weights as for a local directory
        model_path = resolve_model_path(model_path)
        if seed is not None:
            torch.manual_seed(seed)
        from transformers import AutoConfig

        from areal.utils.vlm import is_qwen_vl_config

        is_vlm = is_qwen_vl_config(AutoConfig.from_pretrained(model_path))
        if is_vlm:
            from areal.models.multimodal import model_class_for

            model_cls = model_class_for(AutoConfig.from_pretrained(model_path))
            model = model_cls.from_pretrained(model_path, dtype=getattr(torch, dtype))
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        model = model.to(resolve_device(device))
        tokenizer = None
        tok_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        if any(os.path.exists(os.path.join(model_path, f)) for f in tok_files):
            try:
                tokenizer = AutoTokenizer.from_pretrained(model_path)
            except Exception as e:  # token-id-only serving still works
                logger.warning(
                    "tokenizer at %s failed to load (%s); text prompts disabled", model_path, e
                )
        else:
            logger.info("no tokenizer files in %s; text prompts are disabled", model_path)
        core = GenerationCore(
            model,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            context_length=context_length,
            version=version,
        )
        server = cls(core, tokenizer, model_path)
        if is_vlm:
            from areal.utils.vlm import load_vlm_processor

            server.image_processor = load_vlm_processor(model_path).image_processor
        return server

    # ------------------------------------------------------------------ plumbing
    def build_app(self):
        from aiohttp import web

        from areal.utils import auth

        # control endpoints need the run secret; generation needs the API key when one is set
        middleware = auth.server_middleware(
            CONTROL_PATHS,
            auth.get_run_secret(),
            os.environ.get(auth.SERVER_API_KEY_ENV) or None,
            surface="inference server",
        )
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[middleware])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_get("/version", self.get_version)
        r.add_get("/get_version", self.get_version)
        r.add_post("/set_version", self.set_version)
        r.add_post("/generate", self.generate)
        r.add_post("/score", self.score)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause", self.pause)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/resume", self.resume)
        r.add_post("/continue", self.resume)
        r.add_post("/continue_generation", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/set_cpu_threads", self.set_cpu_threads)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_delta", self.update_weights_from_delta)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/weights_fingerprint", self.weights_fingerprint)
        r.add_post("/commit_weights", self.commit_weights)
        r.add_post("/rollback_weights", self.rollback_weights)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.core.shutdown)

    @staticmethod
    async def _json(request) -> dict[str, Any]:
        from aiohttp import web

        if not request.can_read_body:
            return {}
        try:  # NaN/Infinity are no JSON: refused (they would reach int()/sampling)
            body = await request.json(loads=_strict_json_loads)
        except Exception as e:
            raise web.HTTPBadRequest(
                text=f'{{"object": "error", "code": 400, "type": "BadRequestError", "message": "malformed JSON body: {type(e).__name__}"}}',
                content_type="application/json",
            ) from e
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(
                text='{"object": "error", "code": 400, "type": "BadRequestError", "message": "JSON body must be an object"}',
                content_type="application/json",
            )
        return body

    async def _run_generation(
        self, rid: str, input_ids: list[int], params, mm_inputs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Submit to the core and await its result; aborts the request if the client goes away."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def _cb(result):
            def _set():
                if not fut.done():
                    fut.set_result(result)

            loop.call_soon_threadsafe(_set)

        if mm_inputs is None:
            self.core.submit(rid, input_ids, params, _cb)
        else:
            self.core.submit(rid, input_ids, params, _cb, mm_inputs=mm_inputs)
        try:
            return await fut
        except asyncio.CancelledError:
            self.core.abort(rid)
            raise

    async def _image_inputs(self, image_data: Any) -> dict[str, Any]:
        """Decode + preprocess a request's images in a worker thread (never on the loop),
        once per distinct image list (``ImageInputCache``)."""
        from areal.inference.server.core import RequestError

        image_processor = getattr(self, "image_processor", None)
        if image_processor is None:
            raise RequestError("this server has no image processor: the model takes no images")
        return await self.image_cache.get(image_processor, image_data)

    async def _call_core(self, fut):
        return await asyncio.wrap_future(fut)

    # ------------------------------------------------------------------ basic endpoints
    async def health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "version": self.core.version})

    async def metrics(self, request):
        from aiohttp import web

        return web.json_response(self.core.metrics())

    async def get_version(self, request):
        from aiohttp import web

        return web.json_response({"version": self.core.version})

    async def is_paused(self, request):
        from aiohttp import web

        return web.json_response({"is_paused": self.core.paused})

    async def pause(self, request):
        from aiohttp import web

        mode = request.query.get("mode", "abort")
        if mode != "abort":
            return _error(400, f"pause mode={mode!r}; only 'abort' is supported")
        await self._call_core(self.core.pause())
        return web.json_response({"success": True, "paused": True})

    async def set_cpu_threads(self, request):
        """``{"threads": n}``: torch intra-op threads of the scheduler thread from its next
        iteration (1 <= n <= the CPUs this process may use); answers the previous count."""
        import os

        from aiohttp import web

        body = await self._json(request)
        n, cpus = body.get("threads"), len(os.sched_getaffinity(0))
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cpus:
            return _error(400, f"threads={n!r}; allowed: an integer in [1, {cpus}]")
        previous = await self._call_core(self.core.set_cpu_threads(n))
        return web.json_response({"success": True, "threads": n, "previous": previous})

    async def score(self, request):
        """``{"input_ids": [[ids], ...] | [ids], "temperature": 1.0}``: per-token
        log-probabilities of the given tokens under the current weights
        (``scoring.py``); answers ``{"logprobs": [[...], ...], "version": v}``."""
        from aiohttp import web

        from areal.inference.server.scoring import check_score_request, score_tokens

        body = await self._json(request)
        try:
            seqs, temperature = check_score_request(body, self.core.model.config.vocab_size)
        except ValueError as e:
            return _error(400, str(e))
        model = self.core.model
        logps = await self._call_core(
            self.core.run_command(lambda: score_tokens(model, seqs, temperature))
        )
        return web.json_response({"logprobs": logps, "version": self.core.version})

    async def resume(self, request):
        from aiohttp import web

        await self._call_core(self.core.resume())
        return web.json_response({"success": True, "paused": False})

    async def abort_request(self, request):
        from aiohttp import web

        body = await self._json(request)
        rid = body.get("rid", body.get("request_id"))
        if not isinstance(rid, str):
            return _error(400, "'rid' (str) is required")
        found = self.core.abort(rid)
        return web.json_response({"success": found})

    # ------------------------------------------------------------------ native generate
    async def generate(self, request):
        from aiohttp import web

        from areal.inference.server.core import RequestError, SamplingParams

        body = await self._json(request)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            return _error(400, "'input_ids' must be a list of integers")
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            return _error(400, "'rid' must be a string")
        if not isinstance(body.get("sampling_params") or {}, dict):
            return _error(400, "'sampling_params' must be an object")
        try:
            params = SamplingParams.from_dict(body.get("sampling_params"))
            mm_inputs = None
            if body.get("image_data") is not None:  # vision-language models
                mm_inputs = await self._image_inputs(body["image_data"])
            result = await self._run_generation(rid, input_ids, params, mm_inputs)
        except RequestError as e:
            return _error(400, str(e))
        if "error" in result:
            return _error(500, result["error"])
        return web.json_response(result)
