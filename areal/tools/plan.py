"""``python -m areal.tools.plan --config X.yaml [overrides]``: the memory plan of a run, before
anything starts.

Loads the experiment config as the trainer does (the same YAML + overrides loader, no
file written), reads the model's ``config.json`` (``actor.path``; no weights needed), and
prints per trainer rank (parameters, gradients, optimizer states, activations of one
micro-batch of ``actor.mb_spec.max_tokens_per_mb`` tokens; the critic and reference
models when configured), per inference server (weights, KV cache at the concurrency
``rollout.max_concurrent_rollouts`` x ``gconfig.n_samples`` spread over the servers, for
prompt + ``gconfig.max_new_tokens`` tokens) and the weight-sync volume per step; then
whether the allocation fits ``cluster.n_nodes`` x ``cluster.n_gpus_per_node`` devices of
``--device-memory-gib`` each (on CPU, ``n_gpus_per_node: 0``: every process shares the
host's RAM). Exit code 2, naming the largest item, when it does not fit.
The arithmetic is ``areal.utils.memory_plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from areal.api import cli_args
from areal.api.alloc_mode import AllocationMode, AllocationType
from areal.api.config_loader import build_config
from areal.utils import memory_plan as mp

_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
BUILTIN_MAX_RUNNING = 128  # the built-in server's --max-batch-size default
CONFIG_CLASSES = ("GRPOConfig", "PPOConfig", "SFTConfig", "RWConfig", "DPOConfig")


class PlanError(ValueError):
    """The plan cannot be made (bad flag, missing model config)."""


def _dtype_bytes(name: str, field: str) -> int:
    if name not in _BYTES:
        raise PlanError(f"{field}={name!r}; allowed: {sorted(_BYTES)}")
    return _BYTES[name]


def _model_shape(path: str, field: str) -> mp.ModelShape:
    from areal.utils.hf_utils import is_hub_id, resolve_model_path

    if is_hub_id(path):  # a hub id: its snapshot in the local cache (or downloaded)
        try:
            path = resolve_model_path(path)
        except (OSError, ValueError) as e:
            raise PlanError(f"{field}={path!r}: {e}") from e
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise PlanError(
            f"{field}={path!r}: no config.json there (a local model directory or a hub id"
            " is needed)"
        )
    return mp.ModelShape.from_hf_config(json.loads(cfg_file.read_text()))


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_device_memory(on_gpu: bool) -> int:
    """Bytes per device: the first CUDA device's when there is one, else the host's RAM."""
    if on_gpu:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    return _host_ram()


def _engine_items(eng, shape, layout, on_gpu: bool, trainable: bool) -> dict[str, int]:
    compute = _dtype_bytes(eng.dtype, "dtype") if on_gpu else 4
    opt = eng.optimizer.type if (trainable and eng.optimizer is not None) else "adam"
    if opt == "adam_bf16" and not on_gpu:
        opt = "adam"  # CPU trains in float32
    tokens = eng.mb_spec.max_tokens_per_mb
    if tokens is None:
        raise PlanError(
            "actor.mb_spec.max_tokens_per_mb is not set: the micro-batch size is unknown"
        )
    return mp.trainer_rank_memory(
        shape, layout, tokens, bool(eng.gradient_checkpointing), opt,
        param_bytes=4, compute_bytes=compute, trainable=trainable,
    )  # fmt: skip


def make_plan(config, device_memory: int | None = None, prompt_tokens: int | None = None) -> dict:
    """The plan of ``config`` (a loaded experiment config) as a JSON-ready dict."""
    alloc = AllocationMode.from_str(config.allocation_mode)
    on_gpu = config.cluster.n_gpus_per_node > 0
    if device_memory is None:
        device_memory = default_device_memory(on_gpu)
    plan: dict = {"allocation_mode": str(alloc), "device": "gpu" if on_gpu else "cpu"}
    plan["device_memory_bytes"] = device_memory
    shape = _model_shape(config.actor.path, "actor.path")
    plan["model"] = {"path": config.actor.path, "n_params": shape.n_params()}
    trainer: dict[str, int] = {}
    train = alloc.train
    if train is not None:
        layout = mp.TrainLayout(
            dp=train.dp_size, tp=train.tp_size, cp=train.cp_size, ep=train.ep_size
        )
        plan["train_layout"] = {"backend": alloc.train_backend, **layout.__dict__}
        for k, v in _engine_items(config.actor, shape, layout, on_gpu, True).items():
            trainer[f"actor {k}"] = v
        for name in ("critic", "ref"):
            eng = getattr(config, name, None)  # critic / ref exist on PPO-family configs only
            if eng is None:
                continue
            eshape = _model_shape(eng.path, f"{name}.path")
            for k, v in _engine_items(eng, eshape, layout, on_gpu, name == "critic").items():
                trainer[f"{name} {k}"] = v
    plan["trainer_rank"] = trainer
    server: dict[str, int] = {}
    gen = alloc.gen
    wbytes = _dtype_bytes(config.actor.dtype, "actor.dtype") if on_gpu else 4
    if gen is not None and hasattr(config, "rollout"):
        n_servers = max(1, alloc.gen_n_instances)
        n_samples = config.gconfig.n_samples
        rollouts = config.rollout.max_concurrent_rollouts or config.train_dataset.batch_size
        conc = max(1, -(-rollouts * n_samples // n_servers))
        builtin = alloc.gen_backend == "local"
        if builtin:  # the rest wait in its queue, holding no KV cache
            conc = min(conc, BUILTIN_MAX_RUNNING)
        elif alloc.gen_backend == "sglang" and config.sglang.max_running_requests:
            conc = min(conc, config.sglang.max_running_requests)
        prompt = prompt_tokens or config.train_dataset.max_length
        if prompt is None:
            room = (shape.max_position_embeddings or 2048) - config.gconfig.max_new_tokens
            prompt = max(1, min(1024, room))
        server = mp.server_memory(
            shape, wbytes, wbytes, conc, prompt, config.gconfig.max_new_tokens,
            tp=alloc.gen_instance_size, prompt_cache_bytes=64 * 2**20 if builtin else 0,
        )  # fmt: skip
        plan["server_load"] = {
            "n_servers": n_servers, "concurrent_sequences": conc, "prompt_tokens": prompt,
            "max_new_tokens": config.gconfig.max_new_tokens, "devices_per_server": alloc.gen_instance_size,
        }  # fmt: skip
        plan["weight_sync_bytes_per_step"] = mp.weight_sync_bytes(shape, wbytes) * n_servers
    plan["server_device"] = server
    _fit(plan, alloc, config, on_gpu, device_memory)
    return plan


def _fit(plan: dict, alloc: AllocationMode, config, on_gpu: bool, device_memory: int) -> None:
    """Fill ``fits``, ``needed_bytes`` and (when it does not fit) ``refusal``."""
    t, s = sum(plan["trainer_rank"].values()), sum(plan["server_device"].values())
    everything = {
        **plan["trainer_rank"],
        **{f"server {k}": v for k, v in plan["server_device"].items()},
    }
    if on_gpu:
        devices = config.cluster.n_gpus_per_node * config.cluster.n_nodes
        colocated = alloc.type_ is AllocationType.COLOCATE
        need = t + s if colocated else max(t, s)
        plan["devices"] = {"declared": devices, "needed": alloc.world_size}
        if alloc.world_size > devices:
            plan.update(fits=False, needed_bytes=need)
            plan["refusal"] = (
                f"allocation_mode={alloc} needs {alloc.world_size} devices; the cluster declares "
                f"{devices} (cluster.n_nodes x cluster.n_gpus_per_node)"
            )
            return
        if colocated:
            items, where = everything, "one device (trainer rank + colocated server)"
        elif t >= s:
            items, where = plan["trainer_rank"], "one trainer rank's device"
        else:
            items, where = plan["server_device"], "one inference server's device"
    else:  # CPU: every trainer rank and server process shares the host's RAM
        ranks = alloc.train_world_size
        servers = plan.get("server_load", {}).get("n_servers", 0)
        need = t * ranks + s * servers * max(1, alloc.gen_instance_size)
        where = f"the host ({ranks} trainer rank(s) + {servers} server(s))"
        items = everything
    plan["needed_bytes"] = need
    plan["fits"] = need <= device_memory
    if not plan["fits"]:
        name, size = mp.largest_item(items)
        plan["refusal"] = (
            f"does not fit: {where} needs {need / mp.GiB:.2f} GiB, {device_memory / mp.GiB:.2f} GiB "
            f"available; largest item: {name} ({size / mp.GiB:.2f} GiB)"
        )


def _gib(b: int) -> str:
    return f"{b / mp.GiB:9.3f} GiB"


def format_plan(plan: dict) -> str:
    out = [f"allocation {plan['allocation_mode']} on {plan['device']}; model {plan['model']['path']} "
           f"({plan['model']['n_params'] / 1e6:.1f}M parameters)"]  # fmt: skip
    if plan["trainer_rank"]:
        out.append(f"per trainer rank ({plan['train_layout']}):")
        out += [f"  {k:34s} {_gib(v)}" for k, v in plan["trainer_rank"].items()]
        out.append(f"  {'total':34s} {_gib(sum(plan['trainer_rank'].values()))}")
    if plan["server_device"]:
        out.append(f"per inference server device ({plan['server_load']}):")
        out += [f"  {k:34s} {_gib(v)}" for k, v in plan["server_device"].items()]
        out.append(f"  {'total':34s} {_gib(sum(plan['server_device'].values()))}")
        out.append(
            f"weight sync per step (all servers)  {_gib(plan['weight_sync_bytes_per_step'])}"
        )
    out.append(f"needed {_gib(plan['needed_bytes'])} of {_gib(plan['device_memory_bytes'])} per device: "
               + ("fits" if plan["fits"] else "DOES NOT FIT"))  # fmt: skip
    if not plan["fits"]:
        out.append(plan["refusal"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal.tools.plan", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", required=True, help="experiment YAML")
    ap.add_argument("--config-cls", default="GRPOConfig", choices=CONFIG_CLASSES)
    ap.add_argument("--device-memory-gib", type=float, default=None,
                    help="memory per device; default: the CUDA device's, else the host's RAM")  # fmt: skip
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompt length for the KV cache; default train_dataset.max_length, else "
                         "min(1024, the model's context - max_new_tokens)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        ap.error(
            f"cannot parse {bad}; overrides are 'key.sub=value', '+key.sub=value' or '~key.sub'"
        )
    try:
        if args.device_memory_gib is not None and args.device_memory_gib <= 0:
            raise PlanError(f"--device-memory-gib={args.device_memory_gib}; allowed: a number > 0")
        path = Path(args.config)
        if not path.is_file():
            raise PlanError(f"Config file {str(path)!r} does not exist")
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        config = build_config(raw, overrides, getattr(cli_args, args.config_cls))
        mem = None if args.device_memory_gib is None else int(args.device_memory_gib * mp.GiB)
        plan = make_plan(config, mem, args.prompt_tokens)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    sys.stdout.write((json.dumps(plan, indent=1) if args.json else format_plan(plan)) + "\n")
    if not plan["fits"]:
        sys.stderr.write(f"refused: {plan['refusal']}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
