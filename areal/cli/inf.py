"""``areal inf run --model-path DIR [--backend local:d2] [--port P] ...``.

AReaL 2.0's ``areal inf run`` starts an inference service; here it starts the inference
servers of ``--backend`` (``local``: the built-in server, on CPU or CUDA; ``vllm`` /
``sglang``: their servers, as a trainer would start them), ``dN`` replicas on
consecutive ports from ``--port`` (0: free ports), prints one line per server
(``server <i> http://host:port``) and ``AREAL_LLM_SERVER_ADDRS=...`` once all answer
their health check, and keeps them in the foreground until SIGTERM / Ctrl-C (or one
exits), then stops them all. ``--model`` names the served model (logged; the built-in
server serves one model). ``--engine-args 'k=v k2=v2'`` are extra server flags.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from areal.cli.signals import wait_until_signalled
from areal.cli.train import CliError
from areal.utils import logging

logger = logging.getLogger("ArealCli")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inf",
        help="start inference servers and print their addresses (AReaL 2.0: areal inf run)",
        description="Start inference servers in the foreground until SIGTERM / Ctrl-C. "
        "'areal inf run ...' (AReaL 2.0's form) and 'areal inf ...' are the same.",
    )
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument("--model", default=None, help="name of the served model (logged)")
    p.add_argument(
        "--backend",
        default="local:d1",
        help="backend spec as rollout.backend: 'local:d2', 'vllm:d1t2', 'sglang:d1' "
        "(default local:d1, the built-in server)",
    )
    p.add_argument("--tokenizer-path", default=None, help="accepted as AReaL 2.0; unused")
    p.add_argument("--host", default="127.0.0.1", help="bind host of the servers")
    p.add_argument("--port", type=int, default=0, help="first server's port (0: free ports)")
    p.add_argument("--engine-args", default="", help="extra server flags: 'k=v k2=v2'")
    p.add_argument(
        "--model-health-timeout", type=float, default=600.0, help="seconds to wait for health"
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(func=run)


def parse_engine_args(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in shlex.split(text):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--engine-args: expected key=value items, got {item!r}")
        out[key.lstrip("-").replace("-", "_")] = value
    return out


def launch(args: argparse.Namespace) -> list:
    """Start the servers (module docstring); returns their ``ServerProcess`` objects."""
    from areal.api.alloc_mode import ParallelStrategy
    from areal.api.cli_args import GRPOConfig
    from areal.inference.backends import available_backends, engine_class, make_adapter
    from areal.infra.launcher.server_process import launch_server_process, wait_for_servers
    from areal.utils.network import find_free_ports

    try:
        alloc = ParallelStrategy.parse_backend(args.backend, "--backend")
    except ValueError as e:
        raise CliError(str(e)) from e
    name = alloc.backend
    if name not in available_backends():
        raise CliError(
            f"--backend {args.backend}: {name!r} is not an inference backend; "
            f"allowed: {available_backends()}"
        )
    par = alloc.parallel
    cls = engine_class(name)
    config = GRPOConfig()
    config.actor.path = args.model_path
    try:
        server_args = cls.build_server_args(
            config, model_path=args.model_path, tp_size=par.tp_size, pp_size=par.pp_size
        )
    except ValueError as e:
        raise CliError(f"--backend {args.backend}: {e}") from e
    if name == "local":
        server_args["dtype"] = "float32"  # the built-in server's own default
    server_args.update(parse_engine_args(args.engine_args))
    cmd_str, env = cls.build_server_command(server_args)
    n = par.dp_size
    ports = [args.port + i for i in range(n)] if args.port else find_free_ports(n)
    health = make_adapter(name).health_path
    servers = []
    try:
        for port in ports:
            cmd = [c.format(host=args.host, port=port) for c in shlex.split(cmd_str)]
            if cmd and cmd[0] in ("python", "python3"):
                cmd[0] = sys.executable
            servers.append(
                launch_server_process(
                    cmd, f"{args.host}:{port}", health_path=health, env=env, wait=False
                )
            )
        wait_for_servers(servers, health, args.model_health_timeout)
    except BaseException:
        for s in servers:
            s.stop(timeout=5.0)
        raise
    return servers


def run(args: argparse.Namespace) -> int:
    try:
        servers = launch(args)
    except (RuntimeError, TimeoutError) as e:
        raise CliError(f"the servers did not start: {e}") from e
    try:
        addrs = ",".join(s.address for s in servers)
        lines = [f"server {i} http://{s.address}" for i, s in enumerate(servers)]
        sys.stdout.write("\n".join([*lines, f"AREAL_LLM_SERVER_ADDRS={addrs}"]) + "\n")
        sys.stdout.flush()
        logger.info(
            "serving %s (%s) on %s; SIGTERM / Ctrl-C stops",
            args.model or args.model_path,
            args.backend,
            addrs,
        )
        how = wait_until_signalled(lambda: all(s.alive() for s in servers))
        if how == "exited":
            dead = [s for s in servers if not s.alive()]
            logger.error("server %s exited; log tail:\n%s", dead[0].address, dead[0].log_tail())
            return 1
        return 0
    finally:
        for s in servers:
            s.stop(timeout=10.0)
