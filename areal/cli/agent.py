"""``areal agent run --agent module.Class [--num-pairs N] [--admin-api-key K] ...``.

Two things, chosen by the flags. Without ``--server-addrs`` / ``--model-path`` (AReaL
2.0's ``areal agent run --service default --agent examples.hermes.hermes.HermesAgent
--num-pairs 1 --admin-api-key K``): the agent service (:mod:`areal.v2.agent_service`):
its gateway and ``--num-pairs`` agent workers, each running the ``--agent`` class
(``AgentController`` over a ``LocalScheduler``; logs under
``$TMPDIR/areal/logs/agent-<service>/run0``). Clients post turns to the gateway's ``/v1/responses`` with the
admin key. With ``--server-addrs`` (running inference servers) or ``--model-path``
(start built-in servers first, ``--backend`` as ``areal inf``): the OpenAI-compatible
proxy path instead: ``--num-pairs`` proxy workers (``python -m
areal.experimental.openai.proxy``: chat completions recorded per session, rewards,
export) behind the proxy gateway; ``--agent`` is then only checked and logged.

Either way it prints ``gateway http://...`` once everything answers ``/health`` and
stays in the foreground until SIGTERM / Ctrl-C (2.0 detaches and keeps a state file per
``--service``; here ``--service`` only names the log directory and ``--force`` is
accepted and ignored). The admin key: ``--admin-api-key``, else ``$AREAL_PROXY_ADMIN_KEY``,
else the well-known default, which is refused off loopback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

from areal.cli.signals import wait_until_signalled
from areal.cli.train import CliError
from areal.utils import logging

logger = logging.getLogger("ArealCli")

DEFAULT_ADMIN_KEY = "areal-admin-key"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "agent",
        help="launch the agent service (or the OpenAI-compatible proxy path) (AReaL 2.0: areal "
        "agent run)",
        description="Launch the agent service, or proxy workers and their gateway, in the "
        "foreground until SIGTERM.",
    )
    verbs = p.add_subparsers(dest="agent_verb", metavar="{run}")
    verbs.required = True
    r = verbs.add_parser(
        "run", help="launch the agent service", description=__doc__.split("\n\n")[1]
    )
    r.add_argument("--service", default="default", help="service name (names the log directory)")
    r.add_argument(
        "--agent", default=None, help="agent import path 'module.Class' (or 'module:Class')"
    )
    r.add_argument(
        "--server-addrs", default=None, help="proxy path: running inference servers host:port,..."
    )
    r.add_argument(
        "--model-path", default=None, help="proxy path: start built-in servers of this model"
    )
    r.add_argument("--backend", default="local:d1", help="servers to start with --model-path")
    r.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model-path)")
    r.add_argument("--num-pairs", type=int, default=1, help="agent (or proxy) workers (>= 1)")
    r.add_argument("--host", default="127.0.0.1", help="gateway bind host")
    r.add_argument("--port", type=int, default=0, help="gateway port (0: a free port)")
    r.add_argument("--admin-api-key", default=None, help="default: $AREAL_PROXY_ADMIN_KEY")
    r.add_argument("--session-timeout", type=float, default=3600.0, help="idle session timeout (s)")
    r.add_argument("--setup-timeout", type=float, default=300.0, help="seconds to wait for health")
    r.add_argument(
        "--drain-timeout", type=float, default=30.0, help="agent service: turn drain on scale-down"
    )
    r.add_argument(
        "--health-poll-interval", type=float, default=5.0, help="agent service: worker probes (s)"
    )
    r.add_argument(
        "--request-timeout", type=float, default=600.0, help="agent service: seconds per turn"
    )
    r.add_argument("--force", action="store_true", help="accepted (2.0's state slots); no effect")
    r.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    r.set_defaults(func=run)


def _check_agent(path: str) -> None:
    if os.getcwd() not in sys.path:  # agents named relative to the launch directory
        sys.path.insert(0, os.getcwd())
    mod, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not mod:
        raise CliError(f"--agent must be an import path 'module:Class', got {path!r}")
    try:
        obj = getattr(importlib.import_module(mod), attr, None)
    except ImportError as e:
        raise CliError(f"--agent {path}: cannot import {mod!r}: {e}") from e
    if obj is None:
        raise CliError(f"--agent {path}: {mod!r} has no attribute {attr!r}")


def run(args: argparse.Namespace) -> int:
    if args.num_pairs < 1:
        raise CliError(f"--num-pairs={args.num_pairs}; allowed: >= 1")
    if not args.server_addrs and not args.model_path:
        return run_agent_service(args)
    return run_proxy(args)


def _admin_key(args: argparse.Namespace) -> str:
    from areal.utils import auth

    key = args.admin_api_key or os.environ.get(auth.PROXY_ADMIN_KEY_ENV) or DEFAULT_ADMIN_KEY
    if key == DEFAULT_ADMIN_KEY and args.host not in ("127.0.0.1", "localhost", "::1"):
        raise CliError(
            f"--host {args.host}: set --admin-api-key (the default key is refused off loopback)"
        )
    return key


def run_agent_service(args: argparse.Namespace) -> int:
    """The agent service (AReaL 2.0's ``areal agent run``): gateway + agent workers."""
    from areal.api.cli_args import AgentConfig
    from areal.infra.scheduler.local import LocalScheduler
    from areal.v2.agent_service.controller import AgentController

    if not args.agent:
        raise CliError(
            "--agent is required (the agent service's agent class); or give --server-addrs / "
            "--model-path for the OpenAI-compatible proxy path"
        )
    _check_agent(args.agent)
    config = AgentConfig(
        agent_cls_path=args.agent.replace(":", "."),
        admin_api_key=_admin_key(args),
        session_timeout_seconds=max(1, int(args.session_timeout)),
    )
    scheduler = LocalScheduler(
        experiment_name=f"agent-{args.service}",
        trial_name="run0",
        startup_timeout=args.setup_timeout,
    )
    ctrl = AgentController(
        config,
        scheduler,
        num_pairs=args.num_pairs,
        gateway_host=args.host,
        gateway_port=args.port,
        setup_timeout=args.setup_timeout,
        drain_timeout=args.drain_timeout,
        request_timeout=args.request_timeout,
        health_interval=args.health_poll_interval,
    )
    try:
        ctrl.initialize()
    except (RuntimeError, TimeoutError, ValueError) as e:
        scheduler.delete_workers()
        raise CliError(f"failed to launch the agent service: {e}") from e
    try:
        sys.stdout.write(f"gateway {ctrl.gateway_addr}\n")
        sys.stdout.flush()
        logger.info(
            "service=%s gateway=%s agent=%s pairs=%d; logs in %s",
            args.service,
            ctrl.gateway_addr,
            args.agent,
            len(ctrl.pairs),
            scheduler.log_dir,
        )
        how = wait_until_signalled(lambda: not scheduler.dead_workers("agent-gateway"))
        return 1 if how == "exited" else 0
    finally:
        ctrl.destroy()
        scheduler.delete_workers()


def run_proxy(args: argparse.Namespace) -> int:
    """The OpenAI-compatible proxy path: proxy workers + their gateway."""
    from areal.api.cli_args import AgentConfig
    from areal.experimental.openai.proxy.gateway.launch import proxy_worker_command
    from areal.infra.launcher.server_process import launch_server_process, wait_for_servers
    from areal.utils import auth
    from areal.utils.network import find_free_ports

    tokenizer = args.tokenizer or args.model_path
    if not tokenizer:
        raise CliError("--tokenizer is required with --server-addrs")
    if args.agent:
        _check_agent(args.agent)
    key = _admin_key(args)
    procs = []
    try:
        if args.server_addrs:
            addrs = [a.strip() for a in args.server_addrs.split(",") if a.strip()]
        else:
            from areal.cli.inf import launch

            ns = argparse.Namespace(
                backend=args.backend,
                model_path=args.model_path,
                host="127.0.0.1",
                port=0,
                engine_args="",
                model_health_timeout=args.setup_timeout,
            )
            servers = launch(ns)
            procs += servers
            addrs = [s.address for s in servers]
        cfg = AgentConfig(session_timeout_seconds=int(args.session_timeout))
        cmd = proxy_worker_command(addrs, tokenizer, cfg)
        env = {auth.PROXY_ADMIN_KEY_ENV: key}
        ports = find_free_ports(args.num_pairs)
        workers = [
            launch_server_process(
                [c.format(host="127.0.0.1", port=p) for c in shlex.split(cmd)],
                f"127.0.0.1:{p}",
                env=env,
                wait=False,
            )
            for p in ports
        ]
        procs += workers
        wait_for_servers(workers, "/health", args.setup_timeout)
        gport = args.port or find_free_ports(1)[0]
        gateway_cmd = [
            sys.executable,
            "-m",
            "areal.experimental.openai.proxy.gateway",
            "--workers",
            ",".join(f"http://{w.address}" for w in workers),
            "--host",
            args.host,
            "--port",
            str(gport),
        ]
        gw_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        gateway = launch_server_process(
            gateway_cmd, f"{gw_host}:{gport}", env=env, timeout=args.setup_timeout
        )
        procs.append(gateway)
    except (RuntimeError, TimeoutError) as e:
        for p in reversed(procs):
            p.stop(timeout=5.0)
        raise CliError(f"failed to launch the agent service: {e}") from e
    except BaseException:
        for p in reversed(procs):
            p.stop(timeout=5.0)
        raise
    try:
        sys.stdout.write(f"gateway http://{gateway.address}\n")
        sys.stdout.flush()
        logger.info(
            "agent service up: %d proxy worker(s) over %s%s",
            len(workers),
            addrs,
            f", agent {args.agent}" if args.agent else "",
        )
        how = wait_until_signalled(lambda: all(p.alive() for p in procs))
        return 1 if how == "exited" else 0
    finally:
        for p in reversed(procs):
            p.stop(timeout=10.0)
