"""``RemotevLLMEngine``: ``RemoteInfEngine`` speaking vLLM's OpenAI-compatible server.

Generation: ``POST /v1/completions`` with the prompt as token ids, ``logprobs: 0`` and
``return_tokens_as_token_ids: true`` (token ids parsed from ``"token_id:N"``); the stop
reason is ``choices[0].finish_reason``. Pause/resume and weight reload need the server
started with ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause?mode=abort``, ``POST /resume``,
``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``.

Logprobs: vLLM returns logprobs of the raw logits by default; start it with
``--logprobs-mode processed_logprobs`` to get them after temperature scaling (the
convention of the rest of areal). Distributed (xccl) weight updates need a vLLM worker
extension and are not supported by this adapter. vLLM does not track weight versions;
the client stamps each chunk with its own version.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.remote_inf_engine import (
    BackendAdapter,
    GenChunk,
    HttpCall,
    RemoteInfEngine,
    _stop_reason,
)

ENV_VLLM_PYTHON = "AREAL_VLLM_PYTHON"  # interpreter that starts the vLLM server


def _token_id(tok: str) -> int:
    if isinstance(tok, str) and tok.startswith("token_id:"):
        return int(tok.split(":", 1)[1])
    raise ValueError(f"unexpected token {tok!r}: vLLM must be asked for return_tokens_as_token_ids")


class VLLMBackend(BackendAdapter):
    name = "vllm"

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
            },
        )

    def parse_generate(self, data):
        c = data["choices"][0]
        lp = c.get("logprobs") or {}
        if c.get("token_ids") is not None:
            tokens = [int(t) for t in c["token_ids"]]
        else:
            tokens = [_token_id(t) for t in lp.get("tokens", [])]
        logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs", [])]
        return GenChunk(tokens, logprobs, None, _stop_reason(c.get("finish_reason")))

    def pause_call(self):
        return HttpCall("/pause?mode=abort", None)

    def resume_call(self):
        return HttpCall("/resume", None)

    def update_disk_call(self, path, version):
        return HttpCall(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
        )


class RemotevLLMEngine(RemoteInfEngine):
    def __init__(self, config: InferenceEngineConfig | None = None):
        super().__init__(config, backend=VLLMBackend())

    def launch_server(self, server_args: dict[str, Any]) -> Any:
        """Start one vLLM server (dev mode, for pause/resume/reload): ``server_args`` =
        ``model_path``, ``host``, ``port``, plus flags such as ``dtype``.

        The server runs under the interpreter ``server_args["python"]``, else the env var
        ``AREAL_VLLM_PYTHON``, else ``sys.executable``: vLLM can live in its own venv
        (e.g. ``AREAL_VLLM_PYTHON=/tmp/vllm-venv/bin/python``)."""
        from areal.infra.launcher.local_server import launch_server_process
        from areal.utils.network import find_free_ports

        args = dict(server_args)
        python = args.pop("python", None) or os.environ.get(ENV_VLLM_PYTHON) or sys.executable
        host = args.pop("host", "127.0.0.1")
        port = args.pop("port", None) or find_free_ports(1)[0]
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            args.pop("model_path"),
        ]
        cmd += ["--host", host, "--port", str(port)]
        for k, v in args.items():
            if v is None or v is False:
                continue
            cmd.append("--" + k.replace("_", "-"))
            if v is not True:
                cmd.append(str(v))
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        sp = launch_server_process(
            cmd, f"{host}:{port}", timeout=self.config.setup_timeout, env=env
        )
        self._launched.append(sp)
        return [sp.address]

    def teardown_server(self) -> None:
        while self._launched:
            self._launched.pop().stop()
