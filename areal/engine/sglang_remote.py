"""``RemoteSGLangEngine``: ``RemoteInfEngine`` speaking SGLang's native HTTP API.

Endpoints used: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``;
logprobs from ``meta_info.output_token_logprobs`` = ``[logprob, token_id, text]`` and the
stop reason from ``meta_info.finish_reason.type``), ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/health``. SGLang does not track weight versions;
the client stamps each chunk with its own version.
"""

from __future__ import annotations

import sys
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.remote_inf_engine import BackendAdapter, HttpCall, RemoteInfEngine, _stop_reason


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
        return HttpCall(
            "/generate",
            {
                "rid": rid,
                "input_ids": input_ids,
                "sampling_params": sp,
                "return_logprob": True,
                "stream": False,
            },
        )

    def parse_generate(self, data):
        from areal.infra.remote_inf_engine import GenChunk

        meta = data["meta_info"]
        lps = meta.get("output_token_logprobs") or []
        tokens = [int(x[1]) for x in lps] if lps else list(data.get("output_ids", []))
        return GenChunk(
            tokens, [float(x[0]) for x in lps], None, _stop_reason(meta.get("finish_reason"))
        )

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
    def __init__(self, config: InferenceEngineConfig | None = None):
        super().__init__(config, backend=SGLangBackend())

    def launch_server(self, server_args: dict[str, Any]) -> Any:
        """Start one SGLang server: ``server_args`` = ``model_path``, ``host``, ``port`` + flags."""
        from areal.infra.launcher.local_server import launch_server_process
        from areal.utils.network import find_free_ports

        args = dict(server_args)
        host = args.pop("host", "127.0.0.1")
        port = args.pop("port", None) or find_free_ports(1)[0]
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.pop("model_path")]
        cmd += ["--host", host, "--port", str(port)]
        for k, v in args.items():
            if v is None or v is False:
                continue
            cmd.append("--" + k.replace("_", "-"))
            if v is not True:
                cmd.append(str(v))
        sp = launch_server_process(cmd, f"{host}:{port}", timeout=self.config.setup_timeout)
        self._launched.append(sp)
        return [sp.address]

    def teardown_server(self) -> None:
        while self._launched:
            self._launched.pop().stop()
