"""The built-in inference server (HTTP, aiohttp) and utilities that launch server processes.

Start one server::

    python -m areal.infra.launcher.local_server --model-path DIR --port 8000 [--host 127.0.0.1]
        [--max-batch-size 128] [--dtype float32] [--threads 1]

Start several from Python (each in its own process group, torn down at exit)::

    group = launch_local_server(model_path, num_servers=2)
    group.addresses  # ["127.0.0.1:PORT", ...]
    group.shutdown()

The HTTP surface is documented in ``docs/inference.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from areal.utils import logging

logger = logging.getLogger("LocalServer")


# =====================================================================================
# HTTP application
# =====================================================================================


def _error(status: int, message: str):
    from aiohttp import web

    etype = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(
        status, "InternalServerError"
    )
    return web.json_response(
        {"object": "error", "message": message, "type": etype, "code": status}, status=status
    )


class LocalInferenceServer:
    """Wraps a ``GenerationCore`` with the HTTP endpoints; build with ``from_pretrained``."""

    def __init__(
        self, core, tokenizer=None, model_path: str = "", served_model_name: str | None = None
    ):
        self.core = core
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.model_name = served_model_name or model_path
        self.groups: dict[str, Any] = {}

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
    ) -> LocalInferenceServer:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from areal.engine.local_server.core import GenerationCore

        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
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
        return cls(core, tokenizer, model_path)

    # ------------------------------------------------------------------ plumbing
    def build_app(self):
        from aiohttp import web

        app = web.Application(client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_get("/version", self.get_version)
        r.add_get("/get_version", self.get_version)
        r.add_post("/set_version", self.set_version)
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause", self.pause)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/resume", self.resume)
        r.add_post("/continue", self.resume)
        r.add_post("/continue_generation", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
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
        try:
            body = await request.json()
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

    async def _run_generation(self, rid: str, input_ids: list[int], params) -> dict[str, Any]:
        """Submit to the core and await its result; aborts the request if the client goes away."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def _cb(result):
            def _set():
                if not fut.done():
                    fut.set_result(result)

            loop.call_soon_threadsafe(_set)

        self.core.submit(rid, input_ids, params, _cb)
        try:
            return await fut
        except asyncio.CancelledError:
            self.core.abort(rid)
            raise

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

    async def set_version(self, request):
        from aiohttp import web

        body = await self._json(request)
        v = body.get("version")
        if not isinstance(v, int) or isinstance(v, bool):
            return _error(400, "'version' (int) is required")
        self.core.version = v
        return web.json_response({"success": True, "version": v})

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

        from areal.engine.local_server.core import RequestError, SamplingParams

        body = await self._json(request)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            return _error(400, "'input_ids' must be a list of integers")
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            return _error(400, "'rid' must be a string")
        try:
            params = SamplingParams.from_dict(body.get("sampling_params"))
            result = await self._run_generation(rid, input_ids, params)
        except RequestError as e:
            return _error(400, str(e))
        if "error" in result:
            return _error(500, result["error"])
        return web.json_response(result)

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(self, request):
        from aiohttp import web

        from areal.engine.local_server.weights import load_weights_from_disk

        body = await self._json(request)
        path = body.get("model_path", body.get("path"))
        version = body.get("version")
        if not isinstance(path, str):
            return _error(400, "'model_path' (str) is required")
        if version is not None and not isinstance(version, int):
            return _error(400, "'version' must be an integer")
        t0 = time.monotonic()

        def _do():
            n = load_weights_from_disk(self.core.model, path)
            if version is not None:
                self.core.version = version
            return n

        try:
            n = await self._call_core(self.core.run_command(_do))
        except (FileNotFoundError, ValueError) as e:
            return _error(400, str(e))
        return web.json_response(
            {
                "success": True,
                "num_tensors": n,
                "version": self.core.version,
                "time_s": time.monotonic() - t0,
            }
        )

    async def init_weights_update_group(self, request):
        from aiohttp import web

        from areal.engine.local_server.weights import init_custom_process_group

        body = await self._json(request)
        try:
            host = str(body["master_address"])
            port = int(body["master_port"])
            world_size = int(body["world_size"])
            rank = int(body.get("rank", body.get("rank_offset", 1)))
            group_name = str(body.get("group_name", "areal_weight_update"))
            backend = str(body.get("backend", "gloo"))
            timeout_s = float(body.get("timeout_s", 120.0))
        except (KeyError, TypeError, ValueError) as e:
            return _error(400, f"bad init_weights_update_group request: {e!r}")
        if not 0 < rank < world_size:
            return _error(400, f"rank={rank} must be in [1, world_size={world_size})")
        loop = asyncio.get_running_loop()
        try:
            pg = await loop.run_in_executor(
                None,
                lambda: init_custom_process_group(
                    backend, host, port, world_size, rank, group_name, timeout_s
                ),
            )
        except ValueError as e:
            return _error(400, str(e))
        except Exception as e:
            return _error(500, f"joining group {group_name!r} failed: {e}")
        self.groups[group_name] = pg
        return web.json_response({"success": True, "rank": rank, "group_name": group_name})

    async def update_weights_from_distributed(self, request):
        from aiohttp import web

        from areal.api.io_struct import ParamSpec
        from areal.engine.local_server.weights import receive_bucket

        body = await self._json(request)
        group_name = body.get("group_name", "areal_weight_update")
        pg = self.groups.get(group_name)
        if pg is None:
            return _error(
                400, f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        try:
            if "param_specs" in body:
                specs = [ParamSpec.from_dict(d) for d in body["param_specs"]]
            else:
                specs = [
                    ParamSpec(n, tuple(s), d)
                    for n, s, d in zip(body["names"], body["shapes"], body["dtypes"], strict=True)
                ]
            for s in specs:
                if not isinstance(s.name, str):
                    raise TypeError(f"{s.name!r} is not a name")
                import torch

                if not isinstance(getattr(torch, s.dtype, None), torch.dtype):
                    raise ValueError(f"unknown dtype {s.dtype!r}")
        except (KeyError, TypeError, ValueError) as e:
            return _error(400, f"bad update_weights_from_distributed request: {e!r}")
        version = body.get("version")
        t0 = time.monotonic()

        def _do():
            n = receive_bucket(self.core.model, pg, specs)
            if isinstance(version, int):
                self.core.version = version
            return n

        try:
            n = await self._call_core(self.core.run_command(_do))
        except ValueError as e:
            return _error(400, str(e))
        return web.json_response(
            {
                "success": True,
                "num_tensors": n,
                "version": self.core.version,
                "time_s": time.monotonic() - t0,
            }
        )

    # ------------------------------------------------------------------ OpenAI-compatible
    async def models(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "areal"}],
            }
        )

    def _openai_params(self, body: dict[str, Any]):
        from areal.engine.local_server.core import RequestError, SamplingParams

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

        from areal.engine.local_server.core import RequestError

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

        from areal.engine.local_server.core import RequestError

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


def main(argv: Sequence[str] | None = None) -> None:
    from aiohttp import web

    p = argparse.ArgumentParser(description="areal built-in inference server")
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=128, help="max running requests")
    p.add_argument(
        "--max-prefill-tokens", type=int, default=4096, help="prompt tokens per prefill step"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--context-length", type=int, default=None, help="default: max_position_embeddings"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest on small CPUs)"
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--version", type=int, default=0, help="initial weight version")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    server = LocalInferenceServer.from_pretrained(
        args.model_path,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        seed=args.seed,
        version=args.version,
    )
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(
        server.build_app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )


# =====================================================================================
# Launch utilities
# =====================================================================================

_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


@dataclasses.dataclass(eq=False)
class ServerProcess:
    """One server subprocess (own process group) and its address ``host:port``."""

    proc: subprocess.Popen
    address: str
    log_path: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return "<no log>"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            try:  # children of a dead leader
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with _LIVE_LOCK:
            _LIVE.discard(self)


def _stop_all_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for sp in live:
        sp.stop(timeout=3.0)


atexit.register(_stop_all_live)


def _healthy(address: str, path: str = "/health", timeout: float = 2.0) -> bool:
    import requests

    try:
        return requests.get(f"http://{address}{path}", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def launch_server_process(
    cmd: list[str],
    address: str,
    health_path: str = "/health",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    wait: bool = True,
) -> ServerProcess:
    """Start ``cmd`` in its own process group and (if ``wait``) wait for ``GET health_path``.

    Raises ``RuntimeError`` with the log tail if the process exits before it is healthy,
    ``TimeoutError`` (process killed) if it is not healthy within ``timeout`` seconds.
    """
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="areal-server-", suffix=".log")
        os.close(fd)
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    sp = ServerProcess(proc, address, log_path)
    with _LIVE_LOCK:
        _LIVE.add(sp)
    if wait:
        try:
            wait_for_servers([sp], health_path, timeout)
        except BaseException:
            sp.stop(timeout=3.0)
            raise
    return sp


def wait_for_servers(
    servers: list[ServerProcess], health_path: str = "/health", timeout: float = 120.0
) -> None:
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for sp in list(pending):
            if not sp.alive():
                raise RuntimeError(
                    f"inference server {sp.address} exited with code {sp.proc.returncode} during start; "
                    f"log {sp.log_path} ends with:\n{sp.log_tail()}"
                )
            if _healthy(sp.address, health_path):
                pending.remove(sp)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"inference server(s) {[s.address for s in pending]} not healthy after {timeout:.0f} s; "
                f"log of {pending[0].address}:\n{pending[0].log_tail()}"
            )
        time.sleep(0.2)


@dataclasses.dataclass
class LocalServerGroup:
    servers: list[ServerProcess]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def shutdown(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> LocalServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def local_server_cmd(
    model_path: str, host: str, port: int, server_args: dict[str, Any] | None = None
) -> list[str]:
    cmd = [sys.executable, "-m", "areal.infra.launcher.local_server", "--model-path", model_path]
    cmd += ["--host", host, "--port", str(port)]
    for k, v in (server_args or {}).items():
        if v is None or v is False:
            continue
        cmd.append("--" + k.replace("_", "-"))
        if v is not True:
            cmd.append(str(v))
    return cmd


def launch_local_server(
    model_path: str,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    ports: list[int] | None = None,
    server_args: dict[str, Any] | None = None,
    timeout: float = 120.0,
    log_dir: str | None = None,
) -> LocalServerGroup:
    """Start ``num_servers`` built-in servers and wait until all are healthy."""
    from areal.utils.network import find_free_ports

    ports = list(ports) if ports else find_free_ports(num_servers)
    if len(ports) != num_servers:
        raise ValueError(f"got {len(ports)} ports for num_servers={num_servers}")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    servers: list[ServerProcess] = []
    try:
        for i, port in enumerate(ports):
            log_path = os.path.join(log_dir, f"local_server_{i}.log") if log_dir else None
            servers.append(
                launch_server_process(
                    local_server_cmd(model_path, host, port, server_args),
                    f"{host}:{port}",
                    timeout=timeout,
                    log_path=log_path,
                    wait=False,
                )
            )
        wait_for_servers(servers, timeout=timeout)
    except BaseException:
        for s in servers:
            s.stop(timeout=3.0)
        raise
    logger.info("%d local inference server(s) up: %s", num_servers, [s.address for s in servers])
    return LocalServerGroup(servers)


if __name__ == "__main__":
    main()
