#!/usr/bin/env python3
"""Start (or refresh) one RL session on the proxy and print its session API key.

    python start_session.py http://HOST:PORT --admin-key KEY [--task-id T] [--api-key K]

Without ``--api-key`` the proxy issues a new key. With the key of a live session it
refreshes: the old session is ended (reward 0 if none was set), handed to the trainer,
and a new session is bound to the same key, so the agent needs no reconfiguration. The
key and session id are also written to stderr as ``SESSION_API_KEY=...`` and
``SESSION_ID=...`` lines for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _http import call, fail, report


def main() -> None:
    ap = argparse.ArgumentParser(description="Start or refresh an RL session on the proxy")
    ap.add_argument("gateway_url", help="base URL of the proxy")
    ap.add_argument("--admin-key", default=os.getenv("ADMIN_KEY", "areal-admin-key"))
    ap.add_argument("--task-id", default=os.getenv("TASK_ID", "demo-task"))
    ap.add_argument(
        "--api-key",
        default=os.getenv("SESSION_API_KEY"),
        help="a key issued before: refresh its session (env SESSION_API_KEY)",
    )
    args = ap.parse_args()
    base = args.gateway_url.rstrip("/")
    refresh = args.api_key is not None
    body = {"task_id": args.task_id, "api_key": args.api_key}
    # A refresh may wait for the trainer to take the old episode and grant a new one.
    status, text = call(
        "POST", f"{base}/rl/start_session", args.admin_key, body, 130.0 if refresh else 10.0
    )
    report("refresh session" if refresh else "start session", status, text)
    if status != 200:
        if status == 429:
            fail("no capacity: the trainer has not granted a session yet; retry shortly")
        fail("start_session failed")
    data = json.loads(text)
    print(f"session {data['session_id']}, api key {data['api_key']}")
    print(f"next episode: python start_session.py {base} --api-key {data['api_key']}")
    print(f"SESSION_API_KEY={data['api_key']}", file=sys.stderr)
    print(f"SESSION_ID={data['session_id']}", file=sys.stderr)


if __name__ == "__main__":
    main()
