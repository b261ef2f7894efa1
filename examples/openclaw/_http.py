"""Tiny JSON-over-HTTP helpers shared by the client scripts (standard library only)."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any


def call(
    method: str, url: str, key: str | None = None, body: Any = None, timeout: float = 10.0
) -> tuple[int, str]:
    """``(status, text)`` of one request; ``(0, reason)`` when the server is unreachable."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def report(what: str, status: int, text: str) -> None:
    """Print one exchange: the status line, then the JSON body (indented) or raw text."""
    print(f"{what}: HTTP {status}" if status else f"{what}: no answer ({text})")
    if status and text:
        try:
            print(json.dumps(json.loads(text), indent=2))
        except ValueError:
            print(text)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)
