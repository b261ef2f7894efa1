"""``RemotevLLMEngine``: ``RemoteInfEngine`` speaking vLLM's OpenAI-compatible server.

Generation: ``POST /v1/completions`` with the prompt as token ids, ``logprobs: 0`` and
``return_tokens_as_token_ids: true`` (token ids parsed from ``"token_id:N"``); the stop
reason is ``choices[0].finish_reason``. Pause/resume and weight reload need the server
started with ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause?mode=abort``, ``POST /resume``,
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``.

Logprobs: vLLM returns logprobs of the raw logits by default; start it with
``--logprobs-mode processed_logprobs`` to get them after temperature scaling (the
convention of the rest of areal). Reloads go through areal's worker extension
(``areal.inference.vllm_ext``), which also refreshes pre-packed output layers on CPU.
Distributed (xccl) weight updates are not supported by this adapter. vLLM does not track weight versions;
the client stamps each chunk with its own version.

Prompts with images go through the OpenAI-compatible ``/v1/chat/completions`` with
``image_url`` content parts holding ``data:image/png;base64,...`` URLs (the format vLLM
documents for multimodal chat); the server renders the chat template itself, so the
request needs the chat messages (``ModelRequest.vision_msg_vllm``). Sampling parameters
are carried over from the completions payload; token ids come back as ``token_id:N``
strings and are parsed by :func:`parse_chat_completion`. A request interrupted
mid-generation (pause for a weight update) cannot be resumed from token ids on this
path: it is sent again from the messages. This image format was unit-tested on the
request/response JSON only, not run against a real vLLM server here.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from areal.api.cli_args import VLLM_SERVER_MODULE, InferenceEngineConfig, PPOConfig, vLLMConfig
from areal.api.inference_protocol import BackendAdapter, GenChunk, HttpCall, stop_reason
from areal.inference import vllm_ext
from areal.inference.backends import server_command_line
from areal.inference.clients.image_payloads import as_data_url
from areal.inference.remote.engine import RemoteInfEngine
from areal.utils import logging

logger = logging.getLogger("RemotevLLMEngine")

ENV_VLLM_PYTHON = "AREAL_VLLM_PYTHON"  # interpreter that starts the vLLM server
# vLLMConfig fields (AReaL's schema) that vLLM's V1 server refuses as flags.
_REMOVED_VLLM_FLAGS = ("swap_space",)
_CPU_BLOCK_MULTIPLE = 32  # KV block size granularity of vLLM's CPU attention
# completions fields that chat completions does not take (or takes under another shape)
_NOT_IN_CHAT = ("prompt", "logprobs", "echo", "suffix", "best_of")


def _token_id(tok: str) -> int:
    if isinstance(tok, str) and tok.startswith("token_id:"):
        return int(tok.split(":", 1)[1])
    raise ValueError(f"unexpected token {tok!r}: vLLM must be asked for return_tokens_as_token_ids")


class VLLMBackend(BackendAdapter):
    name = "vllm"
    # Method of areal's worker extension (reload + refresh of pre-packed layers); servers
    # started without the extension can use vLLM's own "reload_weights".
    reload_method = "areal_reload_weights"
    active_lora: str | None = None  # the LoRA adapter requests use (adapter-only syncs)

    def __init__(self, reload_method: str | None = None):
        if reload_method is not None:
            self.reload_method = reload_method

    def generate_call(self, rid, input_ids, p):
        return HttpCall(
            "/v1/completions",
            {
                "prompt": input_ids,
                "max_tokens": p.max_new_tokens,
                "min_tokens": p.min_new_tokens,
                "temperature": 0.0 if p.greedy else p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k if p.top_k < (1 << 30) else -1,
                "stop_token_ids": p.stop_token_ids,
                "ignore_eos": p.ignore_eos,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
                "request_id": rid,
                **({"seed": p.seed} if p.seed is not None else {}),
                **({"model": self.active_lora} if self.active_lora else {}),
            },
        )

    def with_images(self, call, image_data, messages):
        """Images go through the OpenAI-compatible ``/v1/chat/completions`` (module
        docstring): the completions payload's sampling parameters, the chat ``messages``
        with every image part filled (:func:`vllm_chat_messages`)."""
        if not messages:
            raise ValueError(
                "vLLM takes images through chat completions: the request needs the chat "
                "messages (ModelRequest.vision_msg_vllm)"
            )
        chat = {k: v for k, v in (call.payload or {}).items() if k not in _NOT_IN_CHAT}
        chat["messages"] = vllm_chat_messages(messages, image_data)
        chat["logprobs"] = True
        chat["top_logprobs"] = 0
        chat["add_generation_prompt"] = True
        return HttpCall("/v1/chat/completions", chat, call.method)

    def parse_generate(self, data):
        if data.get("object") == "chat.completion":  # a request with images
            return parse_chat_completion(data)
        c = data["choices"][0]
        lp = c.get("logprobs") or {}
        if c.get("token_ids") is not None:
            tokens = [int(t) for t in c["token_ids"]]
        else:
            tokens = [_token_id(t) for t in lp.get("tokens", [])]
        logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs", [])]
        return GenChunk(tokens, logprobs, None, stop_reason(c.get("finish_reason")))

    def pause_call(self):
        return HttpCall("/pause?mode=abort", None)

    def resume_call(self):
        return HttpCall("/resume", None)

    def update_disk_call(self, path, version):
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            # LoRA adapter only (areal.engine.lora): vLLM's dynamic LoRA loading (server
            # started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); later
            # requests name the adapter as their model. Versioned names: a new adapter per
            # sync, never an in-place overwrite of one that requests may still use.
            name = f"areal-lora-v{version}"
            self.active_lora = name
            return HttpCall("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        self.active_lora = None
        return HttpCall(
            "/collective_rpc",
            {"method": self.reload_method, "kwargs": {"weights_path": path}},
        )


class RemotevLLMEngine(RemoteInfEngine):
    """Client of vLLM OpenAI-compatible servers (dev mode; see module docstring)."""

    def __init__(self, config: InferenceEngineConfig | None = None):
        super().__init__(config, backend=VLLMBackend())

    @classmethod
    def build_server_args(
        cls, config: PPOConfig, model_path: str | None = None, tp_size: int = 1, pp_size: int = 1
    ) -> dict[str, Any]:
        """Flags of a vLLM server from an experiment config: every ``config.vllm`` field
        (``vLLMConfig.build_args``) and the model (``vllm.model`` or the actor's path).
        With ``cluster.n_gpus_per_node=0`` (vLLM CPU) the KV ``block_size`` is rounded up
        to a multiple of 32 and chunked prefill is turned off (seeded requests in a chunked
        prefill crash vLLM CPU 0.32)."""
        vcfg = config.vllm
        args = vLLMConfig.build_args(vllm_config=vcfg, tp_size=tp_size, pp_size=pp_size)
        model = model_path or args.get("model") or config.actor.path
        if not model:
            raise ValueError("no model for the vLLM server: set vllm.model or actor.path")
        args["model"] = model
        if args.get("tokenizer") in (None, "") or args.get("tokenizer") == vcfg.model:
            args["tokenizer"] = model
        on_cpu = config.cluster.n_gpus_per_node == 0
        block = int(args.get("block_size") or 0)
        if on_cpu and block % _CPU_BLOCK_MULTIPLE:
            # vLLM's CPU attention needs KV blocks of a multiple of 32 tokens (AReaL's GPU
            # default is 16): a GPU config then runs on CPU unchanged.
            new = max(_CPU_BLOCK_MULTIPLE, -(-block // _CPU_BLOCK_MULTIPLE) * _CPU_BLOCK_MULTIPLE)
            logger.info(
                "cluster.n_gpus_per_node=0: vllm.block_size %d -> %d (vLLM CPU)", block, new
            )
            args["block_size"] = new
        if on_cpu and not args.get("no_enable_chunked_prefill"):
            # vLLM CPU crashes ("CPU Generator does not use offset") when a request with a
            # sampling seed (areal sends one per request) is in a chunked prefill.
            logger.info("cluster.n_gpus_per_node=0: --no-enable-chunked-prefill (vLLM CPU)")
            args["no_enable_chunked_prefill"] = True
        return args

    @classmethod
    def build_server_command(cls, server_args: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """``<python> -m vllm.entrypoints.openai.api_server --host {host} --port {port}
        --flags...`` with ``VLLM_SERVER_DEV_MODE=1`` (pause/resume/reload endpoints).

        The interpreter is ``server_args["python"]``, else the env var ``AREAL_VLLM_PYTHON``,
        else ``python`` (vLLM can live in its own venv). Unless the caller names one, the
        server gets areal's worker extension (``--worker-extension-cls``; it reloads weights
        and refreshes tied/pre-packed output layers, see ``areal.inference.vllm_ext``) and
        ``--logprobs-mode processed_logprobs`` (logprobs after temperature, the convention
        of the rest of areal); ``max_model_len`` is clamped to the model's
        ``max_position_embeddings`` (vLLM refuses a longer one)."""
        args = dict(server_args)
        python = args.pop("python", None) or os.environ.get(ENV_VLLM_PYTHON) or "python"
        if "model_path" in args:  # the name the other backends use
            args["model"] = args.pop("model_path")
        if not args.get("model"):
            raise ValueError("server_args['model'] is required for a vLLM server")
        if not args.get("tokenizer"):
            args["tokenizer"] = args["model"]
        limit = _max_position_embeddings(args["model"])
        if limit is not None and (args.get("max_model_len") or 0) > limit:
            logger.info(
                "vllm.max_model_len=%s exceeds the model's max_position_embeddings=%d; using %d",
                args["max_model_len"],
                limit,
                limit,
            )
            args["max_model_len"] = limit
        for k in _REMOVED_VLLM_FLAGS:  # refused by vLLM's V1 server
            args.pop(k, None)
        if not args.get("worker_extension_cls"):
            args["worker_extension_cls"] = vllm_ext.WORKER_EXTENSION_CLS
        args.setdefault("logprobs_mode", "processed_logprobs")
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (vllm_ext.EXTENSION_DIR, os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        return server_command_line(VLLM_SERVER_MODULE, args, python=python), env


def _max_position_embeddings(model: str) -> int | None:
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            v = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(v) if isinstance(v, int) else None


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
                content[i] = {"type": "image_url", "image_url": {"url": as_data_url(image_data[k])}}
                k += 1
            elif isinstance(part, dict) and part.get("type") == "text":
                content[i] = {"type": "text", "text": part.get("text") or ""}
    if k != len(image_data):
        raise ValueError(f"{len(image_data)} images but {k} image parts in the messages")
    return out


def parse_chat_completion(data: dict[str, Any]) -> GenChunk:
    """A vLLM chat completion (``return_tokens_as_token_ids``) -> ``GenChunk``."""
    c = data["choices"][0]
    content = (c.get("logprobs") or {}).get("content") or []
    if c.get("token_ids") is not None:
        tokens = [int(t) for t in c["token_ids"]]
    else:
        tokens = [int(str(e["token"]).rpartition(":")[2]) for e in content]
    logprobs = [float(e["logprob"]) if e.get("logprob") is not None else 0.0 for e in content]
    return GenChunk(tokens, logprobs, None, stop_reason(c.get("finish_reason")))
