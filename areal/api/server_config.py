"""Inference server arguments and commands: ``vLLMConfig`` and ``SGLangConfig`` (passed on to
the servers as ``--flag value``), ``get_py_cmd`` and the address helpers.

Re-exported by ``areal.api.cli_args``; import from there or from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from areal.api.config_common import NOT_ACTED, cfield, conf_as_dict

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


SGLANG_SERVER_MODULE = "sglang.launch_server"


def get_py_cmd(module: str, args: dict[str, Any], python: str = "python3") -> list[str]:
    """``[python, -m, module]`` plus one ``--flag-name`` per argument.

    ``None``, ``False``, ``""`` and ``[]`` are left out; ``True`` gives a bare flag; a
    list gives the flag followed by its items; anything else the flag and ``str(value)``.
    Underscores in names become dashes.
    """
    cmd = [python, "-m", module]
    for name, value in args.items():
        if (
            value is None
            or value is False
            or value == ""
            or (isinstance(value, (list, tuple)) and not value)
        ):
            continue
        flag = "--" + name.replace("_", "-")
        cmd.append(flag)
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            cmd.extend(str(v) for v in value)
        else:
            cmd.append(str(value))
    return cmd


def with_endpoint(args: dict[str, Any], host: str | None, port: int | None) -> dict[str, Any]:
    """``args`` plus ``host`` and ``port`` where given (the servers' bind address)."""
    if host is not None:
        args["host"] = host
    if port is not None:
        args["port"] = port
    return args


def split_host_port(addr: str) -> tuple[str, int]:
    """``'host:port'`` (or ``'[v6::addr]:port'``) -> ``(host, port)``; ValueError otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {addr!r} is not 'host:port'")
    return host.strip("[]"), int(port)


@dataclass
class vLLMConfig:
    """Arguments of vLLM servers (backend 'vllm'), passed on as `--flag value`."""

    model: str = cfield("", "Model directory or hub name served by vLLM (usually ${actor.path}).")
    seed: int = cfield(1, "Random seed of the server.")
    skip_tokenizer_init: bool = cfield(False, "Do not load a tokenizer (requests carry token ids).")
    enforce_eager: bool = cfield(False, "Disable CUDA graphs / compilation.")
    dtype: str = cfield("bfloat16", "Model dtype in the server.")
    distributed_executor_backend: str = cfield("mp", "vLLM executor for multi-GPU: 'mp' or 'ray'.")
    max_num_seqs: int = cfield(256, "Maximum concurrent sequences per server.")
    block_size: int = cfield(16, "KV-cache block size in tokens.")
    swap_space: int = cfield(4, "CPU swap space per GPU in GiB.")
    cpu_offload_gb: float = cfield(0, "GiB of weights offloaded to CPU.")
    disable_sliding_window: bool = cfield(True, "Disable sliding-window attention.")
    max_model_len: int | None = cfield(32768, "Context length; None for the model's own.")
    no_enable_chunked_prefill: bool = cfield(False, "Pass --no-enable-chunked-prefill.")
    no_enable_prefix_caching: bool = cfield(
        True,
        "Pass --no-enable-prefix-caching (stale cache entries after weight updates otherwise).",
    )
    gpu_memory_utilization: float = cfield(0.9, "Fraction of GPU memory vLLM may use.")
    worker_extension_cls: str = cfield(
        "", "Import path of a vLLM worker extension class (weight updates); empty: none."
    )
    enable_sleep_mode: bool = cfield(False, "Allow the server to release GPU memory while idle.")
    uvicorn_log_level: str = cfield("warning", "Log level of the HTTP server.")
    enable_lora: bool = cfield(False, "Serve LoRA adapters. " + NOT_ACTED)
    max_lora_rank: int = cfield(16, "Maximum LoRA rank. " + NOT_ACTED)
    max_loras: int = cfield(8, "Maximum LoRA adapters at once. " + NOT_ACTED)
    lora_modules: list[str] | None = cfield(None, "LoRA modules to serve. " + NOT_ACTED)
    gdn_prefill_backend: str | None = cfield(
        None, "GDN prefill backend of hybrid models (Qwen3.5): 'triton' or 'flashinfer'."
    )

    @staticmethod
    def build_args(
        vllm_config: vLLMConfig,
        tp_size: int,
        pp_size: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
    ) -> dict[str, Any]:
        """Server arguments (``{name: value}``) of one vLLM server for this config.

        Every field of the config, plus the tokenizer (= ``model``), ``load_format='auto'``,
        ``trust_remote_code``, the tensor/pipeline-parallel sizes, host and port; with
        ``n_nodes > 1`` also ``nnodes``, ``node_rank``, ``master_addr`` / ``master_port``
        (from ``dist_init_addr`` 'host:port') and ``headless`` on non-zero ranks.
        """
        args: dict[str, Any] = {
            "tokenizer": vllm_config.model,
            "load_format": "auto",
            "trust_remote_code": True,
            "tensor_parallel_size": tp_size,
            "pipeline_parallel_size": pp_size,
        }
        args.update(conf_as_dict(vllm_config))
        with_endpoint(args, host, port)
        if n_nodes > 1:
            args["nnodes"] = n_nodes
            args["node_rank"] = node_rank
            if dist_init_addr is not None:
                master_host, master_port = split_host_port(dist_init_addr)
                args["master_addr"] = master_host
                args["master_port"] = str(master_port)
            if node_rank > 0:
                args["headless"] = True
        return args

    @staticmethod
    def build_cmd_from_args(args: dict[str, Any], python: str = "python3") -> list[str]:
        """``[python, -m, vllm.entrypoints.openai.api_server, --flag, value, ...]``."""
        return get_py_cmd(VLLM_SERVER_MODULE, args, python=python)

    @staticmethod
    def build_cmd(
        vllm_config: vLLMConfig,
        tp_size: int,
        pp_size: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
    ) -> list[str]:
        """Command line of one vLLM server: ``build_cmd_from_args(build_args(...))``."""
        return vLLMConfig.build_cmd_from_args(
            vLLMConfig.build_args(
                vllm_config, tp_size, pp_size, host, port, dist_init_addr, n_nodes, node_rank
            )
        )


@dataclass
class SGLangConfig:
    """Arguments of SGLang servers (backend 'sglang'), passed on as `--flag value`."""

    model_path: str = cfield(
        "", "Model directory or hub name served by SGLang (usually ${actor.path})."
    )
    random_seed: int = cfield(1, "Random seed of the server.")
    skip_tokenizer_init: bool = cfield(False, "Do not load a tokenizer (requests carry token ids).")
    disable_cuda_graph: bool = cfield(False, "Disable CUDA graphs.")
    disable_radix_cache: bool = cfield(True, "Disable the prefix (radix) cache.")
    disable_cuda_graph_padding: bool = cfield(False, "Disable CUDA-graph padding.")
    enable_nccl_nvls: bool = cfield(False, "Enable NCCL NVLS.")
    disable_outlines_disk_cache: bool = cfield(False, "Disable the outlines disk cache.")
    disable_custom_all_reduce: bool = cfield(False, "Disable the custom all-reduce kernel.")
    disable_overlap_schedule: bool = cfield(False, "Disable the overlap scheduler.")
    enable_mixed_chunk: bool = cfield(False, "Mix prefill and decode in one batch.")
    enable_dp_attention: bool = cfield(False, "Data-parallel attention.")
    enable_ep_moe: bool = cfield(False, "Expert-parallel MoE.")
    enable_torch_compile: bool = cfield(False, "torch.compile the model.")
    torch_compile_max_bs: int = cfield(32, "Maximum batch size compiled.")
    cuda_graph_max_bs: int | None = cfield(None, "Maximum CUDA-graph batch size.")
    cuda_graph_bs: list[int] | None = cfield(None, "CUDA-graph batch sizes.")
    torchao_config: str = cfield("", "torchao quantisation config.")
    enable_nan_detection: bool = cfield(False, "Detect NaNs in sampling.")
    enable_p2p_check: bool = cfield(False, "Check GPU peer-to-peer access.")
    triton_attention_reduce_in_fp32: bool = cfield(False, "fp32 reduction in triton attention.")
    triton_attention_num_kv_splits: int = cfield(8, "KV splits of triton attention.")
    num_continuous_decode_steps: int = cfield(1, "Decode steps per scheduling round.")
    enable_memory_saver: bool = cfield(False, "Allow releasing GPU memory while idle.")
    allow_auto_truncate: bool = cfield(False, "Truncate over-long prompts instead of failing.")
    attention_backend: str | None = cfield("fa3", "Attention backend.")
    enable_multimodal: bool = cfield(False, "Enable multimodal inputs.")
    sampling_backend: str | None = cfield(None, "Sampling backend.")
    context_length: int | None = cfield(32768, "Context length; None for the model's own.")
    mem_fraction_static: float | None = cfield(
        0.9, "Fraction of GPU memory for weights + KV cache."
    )
    max_running_requests: int | None = cfield(None, "Maximum concurrent requests.")
    chunked_prefill_size: int | None = cfield(-1, "Chunked prefill size; -1 disables.")
    max_prefill_tokens: int = cfield(32768, "Maximum tokens of one prefill batch.")
    schedule_policy: str = cfield("lpm", "Request scheduling policy of the server.")
    schedule_conservativeness: float = cfield(1.0, "Scheduling conservativeness.")
    cpu_offload_gb: int = cfield(0, "GiB of weights offloaded to CPU.")
    dtype: str = cfield("bfloat16", "Model dtype in the server.")
    kv_cache_dtype: str = cfield("auto", "KV-cache dtype.")
    dp_size: int = cfield(1, "Data-parallel size for DP attention.")
    ep_size: int = cfield(1, "Expert-parallel size.")
    enable_lora: bool | None = cfield(None, "Serve LoRA adapters. " + NOT_ACTED)
    max_lora_rank: int | None = cfield(None, "Maximum LoRA rank. " + NOT_ACTED)
    max_loaded_loras: int = cfield(8, "Maximum loaded LoRA adapters. " + NOT_ACTED)
    lora_paths: list[str] | None = cfield(None, "LoRA adapter paths. " + NOT_ACTED)
    lora_backend: str = cfield("triton", "LoRA kernel backend. " + NOT_ACTED)
    log_level: str = cfield("warning", "Server log level.")
    log_level_http: str | None = cfield("warning", "HTTP log level.")
    log_requests: bool = cfield(False, "Log every request.")
    log_requests_level: int = cfield(0, "Verbosity of request logging.")
    show_time_cost: bool = cfield(False, "Log time costs.")
    enable_metrics: bool = cfield(True, "Export Prometheus metrics.")
    decode_log_interval: int = cfield(1, "Decode iterations between throughput logs.")
    enable_multithread_load: bool = cfield(False, "Multi-threaded weight loading.")
    enable_return_routed_experts: bool = cfield(False, "Return MoE routing (internal).")
    load_format: str = cfield("auto", "Weight loading format.")
    enable_deterministic_inference: bool = cfield(False, "SGLang's deterministic inference.")

    @staticmethod
    def build_args(
        sglang_config: SGLangConfig,
        tp_size: int,
        base_gpu_id: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
        pp_size: int = 1,
    ) -> dict[str, Any]:
        """Server arguments (``{name: value}``) of one SGLang server for this config.

        Every field of the config (``enable_multithread_load`` becomes the JSON
        ``model_loader_extra_config``), plus ``tokenizer_path`` (= ``model_path``),
        ``tokenizer_mode`` / ``load_format`` 'auto', ``trust_remote_code``,
        ``is_embedding=False``, ``tp_size``, ``base_gpu_id``, ``nnodes``, ``node_rank``,
        ``dist_init_addr``, and ``pp_size`` (when > 1), host and port when given.
        """
        fields_ = conf_as_dict(sglang_config)
        multithread = fields_.pop("enable_multithread_load", False)
        if multithread:
            fields_["model_loader_extra_config"] = json.dumps(
                {"enable_multithread_load": True}, separators=(",", ":")
            )
        args: dict[str, Any] = {
            "tokenizer_path": sglang_config.model_path,
            "tokenizer_mode": "auto",
            "load_format": "auto",
            "trust_remote_code": True,
            "is_embedding": False,
            "tp_size": tp_size,
            "base_gpu_id": base_gpu_id,
            "nnodes": n_nodes,
            "node_rank": node_rank,
            "dist_init_addr": dist_init_addr,
        }
        args.update(fields_)
        if pp_size > 1:
            args["pp_size"] = pp_size
        return with_endpoint(args, host, port)

    @staticmethod
    def build_cmd_from_args(args: dict[str, Any], python: str = "python3") -> list[str]:
        """``[python, -m, sglang.launch_server, --flag, value, ...]``."""
        return get_py_cmd(SGLANG_SERVER_MODULE, args, python=python)

    @staticmethod
    def build_cmd(
        sglang_config: SGLangConfig,
        tp_size: int,
        base_gpu_id: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
        pp_size: int = 1,
    ) -> list[str]:
        """Command line of one SGLang server: ``build_cmd_from_args(build_args(...))``."""
        return SGLangConfig.build_cmd_from_args(
            SGLangConfig.build_args(
                sglang_config,
                tp_size,
                base_gpu_id,
                host,
                port,
                dist_init_addr,
                n_nodes,
                node_rank,
                pp_size,
            )
        )
