#!/usr/bin/env python3
"""Give a reward to the last call (or one call) of a live session.

python set_reward.py http://HOST:PORT --api-key K [--reward 1.0] [--interaction-id ID]
"""

from __future__ import annotations

import argparse
import os

from _http import call, fail, report


def main() -> None:
    ap = argparse.ArgumentParser(description="Set the reward of a call in an RL session")
    ap.add_argument("gateway_url", help="base URL of the proxy")
    ap.add_argument("--api-key", required=True, help="the session API key")
    ap.add_argument("--reward", type=float, default=float(os.getenv("REWARD", "1.0")))
    ap.add_argument("--interaction-id", default=None, help="a call id (default: the last)")
    args = ap.parse_args()
    body: dict = {"reward": args.reward}
    if args.interaction_id is not None:
        body["interaction_id"] = args.interaction_id
    url = f"{args.gateway_url.rstrip('/')}/rl/set_reward"
    status, text = call("POST", url, args.api_key, body)
    report("set reward", status, text)
    if status != 200:
        fail(f"set_reward failed (HTTP {status})")


if __name__ == "__main__":
    main()
