"""The proxy as its own process, in front of running inference servers.

::

    AREAL_PROXY_ADMIN_KEY=... python -m areal.experimental.openai.proxy \\
        --server-addrs 127.0.0.1:8000,127.0.0.1:8001 --tokenizer MODEL_DIR \\
        [--backend local] [--host 127.0.0.1] [--port 0] [--addr-file PATH] \\
        [--chat-template-type hf] [--engine-max-tokens N] [--online]
        [--start-session-status 201]

The admin key comes from the environment (``AREAL_PROXY_ADMIN_KEY``), never from the
command line; without it a random key is generated and written to ``--admin-key-file``
(default under ``~/.cache/areal``, mode 0600; the path is logged). The well-known
``areal-admin-key`` is refused on a non-loopback ``--host``. The process connects a client engine
of ``--backend`` (the registry in ``areal.inference.backends``) to the servers,
serves the proxy app (see ``server.py``) and, with ``--addr-file``, writes its base URL
there once it accepts requests. ``--online`` enables online-mode grants. SIGTERM / Ctrl-C
stop it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from areal.experimental.openai.proxy.entry import serve_until_signalled
from areal.utils import auth, logging

logger = logging.getLogger("OpenAIProxy")

ADMIN_KEY_ENV = auth.PROXY_ADMIN_KEY_ENV


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="areal OpenAI-compatible proxy")
    p.add_argument("--server-addrs", required=True, help="comma-separated host:port list")
    p.add_argument("--tokenizer", required=True, help="tokenizer (model) directory")
    p.add_argument("--backend", default="local", help="inference backend of the servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--addr-file", default=None, help="write the base URL here when ready")
    p.add_argument("--chat-template-type", default="hf", choices=["hf", "concat"])
    p.add_argument("--tool-call-parser", default="qwen")
    p.add_argument("--reasoning-parser", default="qwen3")
    p.add_argument("--engine-max-tokens", type=int, default=None)
    p.add_argument("--session-timeout-seconds", type=float, default=3600.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--online", action="store_true", help="online-mode grants (429 without)")
    p.add_argument(
        "--start-session-status", type=int, default=200, choices=[200, 201],
        help="HTTP status of a started session (201: AReaL 2.0's v2 gateway)",
    )  # fmt: skip
    p.add_argument("--admin-key-file", default=None, help="where a generated admin key goes")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from areal.api.cli_args import InferenceEngineConfig
    from areal.experimental.openai import ArealOpenAI
    from areal.experimental.openai.proxy.server import ProxyServer
    from areal.inference import backends as inference_backends
    from areal.utils.hf_utils import load_hf_tokenizer

    admin_key = os.environ.get(ADMIN_KEY_ENV) or None
    if admin_key is None:
        admin_key, _ = auth.generate_admin_key_file("proxy", args.admin_key_file)
    engine = inference_backends.make_inference_engine(
        args.backend, InferenceEngineConfig(request_timeout=args.request_timeout)
    )
    engine.initialize(addr=args.server_addrs, train_data_parallel_size=1)
    client = ArealOpenAI(
        engine,
        load_hf_tokenizer(args.tokenizer),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        engine_max_tokens=args.engine_max_tokens,
        chat_template_type=args.chat_template_type,
    )
    server = ProxyServer(
        client,
        admin_api_key=admin_key,
        host=args.host,
        port=args.port,
        session_timeout_seconds=args.session_timeout_seconds,
        capacity_control=args.online,
        start_session_status=args.start_session_status,
    )
    try:
        serve_until_signalled(server, args.addr_file, "proxy")
    finally:
        engine.destroy()


if __name__ == "__main__":
    main()
