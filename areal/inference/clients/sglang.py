"""``RemoteSGLangEngine``: ``RemoteInfEngine`` speaking SGLang's native HTTP API.

Endpoints used: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``;
logprobs from ``meta_info.output_token_logprobs`` = ``[logprob, token_id, text]`` and the
stop reason from ``meta_info.finish_reason.type``), ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/health``. SGLang does not track weight versions;
the client stamps each chunk with its own version. Prompts with images add
``image_data`` (base64 strings) to ``/generate``; these formats were unit-tested on the
request/response JSON only, not run against a real SGLang server here. With
``rollout.return_routed_experts`` the request asks ``return_routed_experts`` (the server
must run with ``--enable-return-routed-experts``, set from the same field) and
``meta_info.routed_experts`` (base64 int32) becomes ``[tokens, n_moe_layers * top_k]``.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from areal.api.cli_args import (
    SGLANG_SERVER_MODULE,
    InferenceEngineConfig,
    PPOConfig,
    SGLangConfig,
)
from areal.api.inference_protocol import BackendAdapter, GenChunk, HttpCall, stop_reason
from areal.inference.backends import server_command_line
from areal.inference.clients.image_payloads import as_base64
from areal.inference.remote.engine import RemoteInfEngine


class SGLangBackend(BackendAdapter):
    name = "sglang"

    def generate_call(self, rid, input_ids, p):
        sp = {
            "max_new_tokens": p.max_new_tokens,
            "min_new_tokens": p.min_new_tokens,
            "temperature": 0.0 if p.greedy else p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k < (1 << 30) else -1,
            "stop_token_ids": p.stop_token_ids,
            "ignore_eos": p.ignore_eos,
            "skip_special_tokens": False,
        }
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        payload = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": sp,
            "return_logprob": True,
            "stream": False,
        }
        if p.return_routed_experts:  # needs the server's --enable-return-routed-experts
            payload["return_routed_experts"] = True
        return HttpCall("/generate", payload)

    def parse_generate(self, data):
        meta = data["meta_info"]
        lps = meta.get("output_token_logprobs") or []
        tokens = [int(x[1]) for x in lps] if lps else list(data.get("output_ids", []))
        return GenChunk(
            tokens,
            [float(x[0]) for x in lps],
            None,
            stop_reason(meta.get("finish_reason")),
            routed_experts=sglang_routed_experts(meta),
        )

    def with_images(self, call, image_data, messages):
        """SGLang's native ``/generate``: ``input_ids`` already hold the expanded image pad
        tokens and ``image_data`` is the list of images (base64 strings; SGLang also
        accepts URLs or file names, one per image)."""
        payload = dict(call.payload or {})
        payload["image_data"] = [as_base64(im) for im in image_data]
        return HttpCall(call.path, payload, call.method)

    def pause_call(self):
        return HttpCall("/pause_generation", {})

    def resume_call(self):
        return HttpCall("/continue_generation", {})

    def update_disk_call(self, path, version):
        return HttpCall(
            "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True}
        )

    def init_group_call(self, meta, rank, world_size):
        return HttpCall(
            "/init_weights_update_group",
            {
                "master_address": meta.master_address,
                "master_port": meta.master_port,
                "rank_offset": rank,
                "world_size": world_size,
                "group_name": meta.group_name,
                "backend": meta.backend or "nccl",
            },
        )

    def update_distributed_call(self, meta, specs, version):
        return HttpCall(
            "/update_weights_from_distributed",
            {
                "names": [s.name for s in specs],
                "dtypes": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs],
                "group_name": meta.group_name,
                "flush_cache": True,
            },
        )


class RemoteSGLangEngine(RemoteInfEngine):
    """Client of SGLang servers (native API; see module docstring)."""

    def __init__(self, config: InferenceEngineConfig | None = None):
        super().__init__(config, backend=SGLangBackend())

    @classmethod
    def build_server_args(
        cls, config: PPOConfig, model_path: str | None = None, tp_size: int = 1, pp_size: int = 1
    ) -> dict[str, Any]:
        """Flags of an SGLang server from an experiment config: every ``config.sglang``
        field (``SGLangConfig.build_args``) and the model (``sglang.model_path`` or the
        actor's path)."""
        if pp_size != 1:
            raise ValueError(f"SGLang servers take no pipeline parallelism: pp_size={pp_size}")
        args = SGLangConfig.build_args(sglang_config=config.sglang, tp_size=tp_size, base_gpu_id=0)
        model = model_path or args.get("model_path") or config.actor.path
        if not model:
            raise ValueError("no model for the SGLang server: set sglang.model_path or actor.path")
        args["model_path"] = model
        if config.rollout.return_routed_experts:  # as AReaL: the rollout field turns it on
            args["enable_return_routed_experts"] = True
        return args

    @classmethod
    def build_server_command(cls, server_args: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """``python -m sglang.launch_server --host {host} --port {port} --flags...``."""
        return server_command_line(SGLANG_SERVER_MODULE, server_args), {}


def sglang_routed_experts(meta: dict[str, Any]) -> np.ndarray | None:
    """SGLang's ``meta_info["routed_experts"]``: base64 of int32 expert ids, one row per
    token the server ran (prompt + completion - 1), ``n_moe_layers * top_k`` per row."""
    raw = meta.get("routed_experts")
    if raw is None:
        return None
    rows = int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1
    flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    if rows <= 0 or flat.size % rows:
        raise ValueError(
            f"SGLang returned {flat.size} routed expert ids for {rows} tokens (not a multiple)"
        )
    return flat.reshape(rows, -1)
