"""The health monitor: a server behind a cut link (probes time out) must not make a
server that answers every probe look hung (its silence was measured up to the end of the
slowest probe of the round)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from areal.api.cli_args import InferenceEngineConfig

# serial: never beside another test file (`make check` runs these alone; Makefile)
pytestmark = pytest.mark.serial


class _Handler(http.server.BaseHTTPRequestHandler):
    silent = threading.Event()

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.server.can_go_silent and self.silent.is_set():
            time.sleep(5)  # a cut link: no answer within the probe timeout
            return
        body = json.dumps({"status": "ok", "version": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def _serve(can_go_silent: bool) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.can_go_silent = can_go_silent
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.slow  # ~15 s: import + a few 1 s probe rounds
def test_health_loop_silent_peer_marked_hung_answering_server_stays_healthy():
    from areal.inference.clients.local import RemoteLocalEngine

    fast, cut = _serve(False), _serve(True)
    addrs = [f"127.0.0.1:{s.server_address[1]}" for s in (fast, cut)]
    eng = RemoteLocalEngine(
        InferenceEngineConfig(
            setup_timeout=30, request_timeout=30, health_check_interval=1.0,
            health_check_timeout=1.0,
        )
    )  # fmt: skip
    eng.initialize(addrs)
    try:
        _Handler.silent.set()
        deadline = time.monotonic() + 20
        while addrs[1] not in eng.hung_addresses:
            assert time.monotonic() < deadline, "the silent server was never declared hung"
            time.sleep(0.1)
        time.sleep(4)  # a few more rounds, each waiting for the silent server's probe
        assert eng.healthy_addresses == [addrs[0]]
        assert eng.hung_addresses == [addrs[1]]
    finally:
        _Handler.silent.clear()
        eng.destroy()
        fast.shutdown()
        cut.shutdown()
