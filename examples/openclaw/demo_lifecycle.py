#!/usr/bin/env python3
"""Several episodes with one session key: start, chat, reward, then refresh with the key.

    python demo_lifecycle.py [http://HOST:PORT] --admin-key KEY [--episodes 2]
        [--task-id T] [--reward R] [--model M] [--prompt P]

Episode 1 starts a session with a new key; every later episode starts with the same
key, which ends the previous session (the trainer receives it) and opens the next. The
last session stays open: the next refresh, or the end of training, closes it.
"""

from __future__ import annotations

import argparse
import json
import os

from _http import call, fail, report


def main() -> None:
    ap = argparse.ArgumentParser(description="Multi-episode online RL demo with one key")
    ap.add_argument("gateway_url", nargs="?", default="http://localhost:8090")
    ap.add_argument("--admin-key", default=os.getenv("ADMIN_KEY", "areal-admin-key"))
    ap.add_argument("--task-id", default=os.getenv("TASK_ID", "demo-task"))
    ap.add_argument("--reward", default=os.getenv("REWARD", "1.0"))
    ap.add_argument("--model", default=os.getenv("MODEL", "default"))
    ap.add_argument(
        "--prompt", default=os.getenv("PROMPT", "Solve step by step: What is 12 * 15 + 3?")
    )
    ap.add_argument("--episodes", type=int, default=2)
    args = ap.parse_args()
    base = args.gateway_url.rstrip("/")
    reward = float(args.reward)

    status, text = call("GET", f"{base}/health")
    report("health", status, text)
    if status != 200:
        fail(f"the proxy at {base} is not answering; start the trainer first")

    chat = {
        "model": args.model,
        "messages": [
            {"role": "system", "content": "You are a patient math tutor."},
            {"role": "user", "content": args.prompt},
        ],
        "temperature": 0.7,
        "max_tokens": 512,
    }
    key: str | None = None
    for episode in range(1, args.episodes + 1):
        start = {"task_id": args.task_id}
        if key is not None:
            start["api_key"] = key
        status, text = call(
            "POST", f"{base}/rl/start_session", args.admin_key, start, 130.0 if key else 10.0
        )
        report(f"episode {episode}: start_session", status, text)
        if status != 200:
            fail("start_session failed (429: the trainer has not granted capacity yet)")
        session = json.loads(text)
        key = session["api_key"]

        status, text = call("POST", f"{base}/chat/completions", key, chat, 30.0)
        report(f"episode {episode}: chat/completions", status, text)
        if status != 200:
            fail(f"chat completion failed (HTTP {status})")
        answer = json.loads(text)["choices"][0]["message"].get("content") or ""
        print(f"episode {episode}: the model answered {len(answer)} characters")

        status, text = call("POST", f"{base}/rl/set_reward", key, {"reward": reward})
        report(f"episode {episode}: set_reward", status, text)
        if status != 200:
            fail(f"set_reward failed (HTTP {status})")
        print(f"episode {episode}: session {session['session_id']}, reward {reward}")
    print(f"done: {args.episodes} episodes with one key; the last session is still open")


if __name__ == "__main__":
    main()
