"""Reading the JSON-lines files a run appends to (``stats.jsonl``, ``health.jsonl``, ...)
while it is still running."""

from __future__ import annotations

import json
import os
from typing import Any


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The complete rows of ``path`` ([] when it does not exist yet). A last line without
    its newline is being written by the run right now (a row longer than a page reaches
    the file in pieces) and is left out: the next read has it whole."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
