"""Command line of the built-in server: ``python -m areal.inference.server --model-path DIR``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from areal.utils import logging

logger = logging.getLogger("LocalServer")


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
    p.add_argument(
        "--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N"
    )
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from areal.infra import stack_dump

    stack_dump.install_process_handler("server")  # the controller's hang dumps reach us
    from areal.inference.server.app import LocalInferenceServer

    server = LocalInferenceServer.from_pretrained(
        args.model_path,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        seed=args.seed,
        version=args.version,
        device=args.device,
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
    # Stopped (SIGTERM/SIGINT): aiohttp has closed the sockets and the shutdown hook has
    # failed the open requests and joined the generation thread. Skip the interpreter's
    # teardown (collecting torch's and transformers' ~400k objects took 5-12 s, past the
    # scheduler's SIGTERM grace, so every stop ended in a SIGKILL).
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
