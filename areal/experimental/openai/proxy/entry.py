"""What the proxy's and the gateway's process entries share: serve until SIGTERM/SIGINT.

In order: install the signal handlers, start ``server``, write its base URL to
``addr_file`` (atomically, through a ``.tmp`` file; skipped when ``addr_file`` is empty),
wait for a signal, stop the server.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from areal.utils import logging

logger = logging.getLogger("ProxyEntry")


def serve_until_signalled(server: Any, addr_file: str | None, what: str) -> None:
    """Run ``server`` (``start()``, ``stop()``, ``base_url``) until SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    try:
        if addr_file:
            tmp = addr_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(server.base_url)
            os.replace(tmp, addr_file)
        stop.wait()
    finally:
        logger.info("stopping the %s at %s", what, server.base_url)
        server.stop()
