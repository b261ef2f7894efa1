"""The gateway as its own process, in front of running proxy workers.

::

    AREAL_PROXY_ADMIN_KEY=... python -m areal.experimental.openai.proxy.gateway \\
        --workers http://127.0.0.1:9001,http://127.0.0.1:9002 \\
        [--host 127.0.0.1] [--port 0] [--addr-file PATH] [--admin-key-file PATH]

The admin key (the proxy workers' admin key) comes from the environment
(``AREAL_PROXY_ADMIN_KEY``), never from the command line; without it a random key is
generated and written to ``--admin-key-file`` (mode 0600, path logged). The default
``areal-admin-key`` is refused on a non-loopback ``--host``. With ``--addr-file`` the
gateway writes its base URL there once it accepts requests. SIGTERM / Ctrl-C stop it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from areal.experimental.openai.proxy.entry import serve_until_signalled
from areal.experimental.openai.proxy.gateway.server import GatewayServer
from areal.utils import auth, logging

logger = logging.getLogger("ProxyGateway")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="areal proxy gateway")
    p.add_argument("--workers", required=True, help="comma-separated proxy worker base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--addr-file", default=None, help="write the base URL here when ready")
    p.add_argument("--admin-key-file", default=None, help="where a generated admin key goes")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--health-interval", type=float, default=1.0)
    args = p.parse_args(argv)
    server = GatewayServer(
        [u.strip() for u in args.workers.split(",") if u.strip()],
        admin_api_key=os.environ.get(auth.PROXY_ADMIN_KEY_ENV) or None,
        host=args.host,
        port=args.port,
        key_file=args.admin_key_file,
        request_timeout=args.request_timeout,
        health_interval=args.health_interval,
    )
    serve_until_signalled(server, args.addr_file, "gateway")


if __name__ == "__main__":
    main()
