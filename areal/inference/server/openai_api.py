"""OpenAI-compatible endpoints of the built-in server: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (a mixin of ``LocalInferenceServer``, which provides ``core``,
``tokenizer``, ``model_name``, ``_json`` and ``_run_generation``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any


def error_response(status: int, message: str):
    from aiohttp import web

    etype = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(
        status, "InternalServerError"
    )
    return web.json_response(
        {"object": "error", "message": message, "type": etype, "code": status}, status=status
    )


_error = error_response


class OpenAIRoutes:
    """Handlers of the OpenAI-compatible endpoints (see module docstring)."""

    async def models(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "areal"}],
            }
        )

    def _openai_params(self, body: dict[str, Any]):
        from areal.inference.server.requests import RequestError, SamplingParams

        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
        d = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": body.get("min_tokens", 0),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", -1),
            "stop_token_ids": body.get("stop_token_ids") or [],
            "ignore_eos": body.get("ignore_eos", False),
        }
        if d["max_new_tokens"] is None:
            d["max_new_tokens"] = self.core.context_length
        n = body.get("n", 1)
        if not isinstance(n, int) or n < 1 or n > 64:
            raise RequestError("'n' must be an integer in [1, 64]")
        return SamplingParams.from_dict(d), n

    def _tok_str(self, t: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{t}"
        return self.tokenizer.decode([t])

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _run_n(self, base: str, ids: list[int], params, n: int) -> list[dict[str, Any]]:
        results = await asyncio.gather(
            *[self._run_generation(f"{base}-{i}", ids, params) for i in range(n)]
        )
        for r in results:
            if "error" in r:
                raise RuntimeError(r["error"])
        return list(results)

    async def completions(self, request):
        from aiohttp import web

        from areal.inference.server.requests import RequestError

        body = await self._json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return _error(
                    400, "this model has no tokenizer; send 'prompt' as a list of token ids"
                )
            ids = self.tokenizer.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = prompt
        else:
            return _error(400, "'prompt' must be a string or a non-empty list of token ids")
        as_ids = bool(body.get("return_tokens_as_token_ids", False))
        want_lp = body.get("logprobs") is not None
        rid = (
            request.headers.get("X-Request-Id")
            or body.get("request_id")
            or f"cmpl-{uuid.uuid4().hex}"
        )
        try:
            params, n = self._openai_params(body)
            results = await self._run_n(rid, ids, params, n)
        except RequestError as e:
            return _error(400, str(e))
        except RuntimeError as e:
            return _error(500, str(e))
        choices = []
        for i, r in enumerate(results):
            c: dict[str, Any] = {
                "index": i,
                "text": self._decode(r["output_ids"]),
                "finish_reason": r["finish_reason"],
                "logprobs": None,
            }
            if want_lp:
                c["logprobs"] = {
                    "tokens": [self._tok_str(t, as_ids) for t in r["output_ids"]],
                    "token_logprobs": r["output_logprobs"],
                    "top_logprobs": None,
                    "text_offset": None,
                }
            if body.get("return_token_ids"):
                c["token_ids"] = r["output_ids"]
                c["prompt_token_ids"] = ids
            c["output_versions"] = r["output_versions"]
            choices.append(c)
        completion = sum(len(r["output_ids"]) for r in results)
        return web.json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": completion,
                    "total_tokens": len(ids) + completion,
                },
            }
        )

    async def chat_completions(self, request):
        from aiohttp import web

        from areal.inference.server.requests import RequestError

        body = await self._json(request)
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            return _error(400, "'messages' must be a non-empty list of {role, content} objects")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return _error(
                400, "this model has no tokenizer chat template; use /v1/completions with token ids"
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = [int(t) for t in ids]
        except Exception as e:
            return _error(400, f"chat template failed: {e}")
        want_lp = bool(body.get("logprobs", False))
        rid = request.headers.get("X-Request-Id") or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            params, n = self._openai_params(body)
            results = await self._run_n(rid, ids, params, n)
        except RequestError as e:
            return _error(400, str(e))
        except RuntimeError as e:
            return _error(500, str(e))
        choices = []
        for i, r in enumerate(results):
            c: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": self._decode(r["output_ids"])},
                "finish_reason": r["finish_reason"],
                "logprobs": None,
            }
            if want_lp:
                c["logprobs"] = {
                    "content": [
                        {"token": self._tok_str(t, False), "logprob": lp}
                        for t, lp in zip(r["output_ids"], r["output_logprobs"])
                    ]
                }
            if body.get("return_token_ids"):
                c["token_ids"] = r["output_ids"]
                c["prompt_token_ids"] = ids
            choices.append(c)
        completion = sum(len(r["output_ids"]) for r in results)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": completion,
                    "total_tokens": len(ids) + completion,
                },
            }
        )
