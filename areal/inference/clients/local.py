"""``RemoteLocalEngine``: ``RemoteInfEngine`` for the built-in server (``areal.inference.server``).

``LocalBackend`` is its protocol adapter: native ``/generate`` with per-token weight
versions, ``/pause`` / ``/continue``, ``/update_weights_from_disk`` (with the version), ``/update_weights_from_delta``,
the gloo/nccl broadcast group (``/init_weights_update_group``,
``/update_weights_from_distributed``) and ``/set_version``. Prompts with images carry
``image_data`` (base64 strings) beside ``input_ids`` holding the image pad tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal.api.cli_args import InferenceEngineConfig, PPOConfig
from areal.api.inference_protocol import BackendAdapter, GenChunk, HttpCall, stop_reason
from areal.inference.backends import server_command_line
from areal.inference.clients.image_payloads import as_base64
from areal.inference.remote.engine import RemoteInfEngine
from areal.inference.server.launch import launch_local_server

SERVER_MODULE = "areal.inference.server"


class LocalBackend(BackendAdapter):
    """The built-in server's protocol."""

    name = "local"
    reports_versions = True

    def generate_call(self, rid, input_ids, p):
        return HttpCall(
            "/generate",
            {"rid": rid, "input_ids": input_ids, "sampling_params": dataclasses.asdict(p)},
        )

    def parse_generate(self, data):
        return GenChunk(
            list(data["output_ids"]),
            list(data["output_logprobs"]),
            list(data["output_versions"]),
            stop_reason(data["finish_reason"]),
            routed_experts=data.get("routed_experts"),
        )

    def with_images(self, call, image_data, messages):
        """``input_ids`` already hold the expanded image pad tokens (as the HF processor
        writes them); ``image_data`` is the list of images as base64 strings."""
        payload = dict(call.payload or {})
        payload["image_data"] = [as_base64(im) for im in image_data]
        return HttpCall(call.path, payload, call.method)

    def updates_in_flight(self, meta):
        # full weights are staged beside the live ones (local_server.weight_routes); a
        # LoRA adapter is merged into the live weights
        return meta.type in ("disk", "xccl") and not meta.use_lora

    def pause_call(self):
        return HttpCall("/pause")

    def resume_call(self):
        return HttpCall("/continue")

    def update_disk_call(self, path, version):
        return HttpCall("/update_weights_from_disk", {"model_path": path, "version": version})

    def update_delta_call(self, path, version):
        return HttpCall("/update_weights_from_delta", {"model_path": path, "version": version})

    def init_group_call(self, meta, rank, world_size):
        return HttpCall(
            "/init_weights_update_group",
            {
                "master_address": meta.master_address,
                "master_port": meta.master_port,
                "rank": rank,
                "world_size": world_size,
                "group_name": meta.group_name,
                "backend": meta.backend or "gloo",
                "timeout_s": meta.timeout_s,
            },
        )

    def update_distributed_call(self, meta, specs, version):
        return HttpCall(
            "/update_weights_from_distributed",
            {
                "group_name": meta.group_name,
                "param_specs": [s.to_dict() for s in specs],
                "version": version,
            },
        )

    def set_version_call(self, version):
        return HttpCall("/set_version", {"version": version})

    def commit_call(self, version):
        return HttpCall("/commit_weights", {"version": version})

    def cpu_threads_call(self, threads):
        return HttpCall("/set_cpu_threads", {"threads": int(threads)})

    def rollback_call(self, previous_path):  # the server restores the copy it kept
        return HttpCall("/rollback_weights", {})


class RemoteLocalEngine(RemoteInfEngine):
    """Client of built-in servers (``python -m areal.inference.server``)."""

    def __init__(self, config: InferenceEngineConfig | None = None):
        super().__init__(config, backend=LocalBackend())

    @classmethod
    def build_server_args(
        cls, config: PPOConfig, model_path: str | None = None, tp_size: int = 1, pp_size: int = 1
    ) -> dict[str, Any]:
        """Flags of a built-in server from an experiment config: the actor's model and
        dtype, the top-level seed. ``tp_size``/``pp_size`` must be 1 (one CPU process)."""
        if tp_size != 1 or pp_size != 1:
            raise ValueError(
                f"the built-in 'local' server runs one process per replica: tp_size={tp_size}, "
                f"pp_size={pp_size}; allowed: 1 (use 'local:dN')"
            )
        return {
            "model_path": model_path or config.actor.path,
            "dtype": config.actor.dtype,
            "seed": int(config.seed),
        }

    @classmethod
    def build_server_command(cls, server_args: dict[str, Any]) -> tuple[str, dict[str, str]]:
        if not server_args.get("model_path"):
            raise ValueError("server_args['model_path'] is required for a built-in server")
        return server_command_line(SERVER_MODULE, server_args), {"OMP_NUM_THREADS": "1"}

    def launch_server(self, server_args: dict[str, Any]) -> list[str]:
        """Start built-in servers: ``server_args`` = ``model_path``, optional ``num_servers``,
        ``host``, ``ports``, ``log_dir`` and server flags (e.g. ``max_batch_size``).
        Returns the list of addresses."""
        args = dict(server_args)
        group = launch_local_server(
            args.pop("model_path"),
            num_servers=args.pop("num_servers", 1),
            host=args.pop("host", "127.0.0.1"),
            ports=args.pop("ports", None),
            log_dir=args.pop("log_dir", None),
            timeout=self.config.setup_timeout,
            server_args=args,
        )
        self._launched.append(group)
        return group.addresses
