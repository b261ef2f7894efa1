"""Reading dataset files and dropping over-long rows, shared by the text and image loaders.

- :func:`resolve_file`: the file of a split, given a file or a directory (also the layout of
  a hub dataset snapshot);
- :func:`read_rows`: the raw rows of a JSON-lines / JSON-array / parquet file;
- :class:`LengthFilter`: drops rows longer than ``max_length`` tokens, counts them, and
  builds the ``datasets.Dataset`` of the rows kept (logging how many were dropped; raising
  when none is left).
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any


def resolve_file(path: str, split: str, subset: str | None = None) -> Path:
    """The file of ``split``; in a directory also ``{subset}/{split}-*.parquet`` (the
    layout of a hub dataset snapshot, e.g. ``main/train-00000-of-00001.parquet``)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        candidates = [
            p / f"{split}.jsonl",
            p / f"{split}.json",
            p / f"{split}.parquet",
            *sorted(Path(x) for x in glob.glob(str(p / f"{split}-*.parquet"))),
            *sorted(Path(x) for x in glob.glob(str(p / (subset or "main") / f"{split}-*.parquet"))),
            *sorted(Path(x) for x in glob.glob(str(p / "data" / f"{split}-*.parquet"))),
        ]
        for c in candidates:
            if c.is_file():
                return c
        raise FileNotFoundError(
            f"no '{split}' split in directory {p}: expected {split}.jsonl, {split}.json, "
            f"{split}.parquet or {split}-*.parquet"
        )
    raise FileNotFoundError(
        f"dataset path {path!r} does not exist (nothing is downloaded at run time)"
    )


def read_rows(path: str, split: str, subset: str | None = None) -> tuple[list, int]:
    """Raw rows of a JSON-lines / JSON-array / parquet file; returns (rows, unparseable lines).

    Unparseable JSON lines are returned as ``None`` so that the caller counts them as bad.
    """
    file = resolve_file(path, split, subset)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist(), 0
    text = file.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from e
        return list(data), 0
    rows: list = []
    n_bad_json = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append(None)
            n_bad_json += 1
    return rows, n_bad_json


class LengthFilter:
    """Drop rows longer than ``max_length`` tokens (``None``: keep every row) and build the
    dataset of the rest.

    Call :meth:`too_long` with each row's token count (it counts the rows it rejects), then
    :meth:`dataset` with the rows kept.
    """

    def __init__(self, max_length: int | None, source: str, logger: Any, what: str = "rows"):
        self.max_length = max_length
        self.source = source
        self.logger = logger
        self.what = what
        self.n_long = 0

    def too_long(self, n_tokens: int) -> bool:
        if self.max_length is not None and n_tokens > self.max_length:
            self.n_long += 1
            return True
        return False

    def dataset(self, kept: list[dict], n_rows: int, type: str):
        """``datasets.Dataset`` of ``kept``; ``ValueError`` when every row was too long."""
        from datasets import Dataset

        if self.n_long:
            self.logger.info(
                "%s: dropped %d of %d %s longer than max_length=%s tokens",
                self.source,
                self.n_long,
                n_rows,
                self.what,
                self.max_length,
            )
        if not n_rows:
            raise ValueError(f"{self.source}: no {self.what}")
        if not kept:
            raise ValueError(
                f"{self.source}: every one of the {n_rows} {self.what} is longer than "
                f"max_length={self.max_length}"
            )
        self.logger.info("%s: %d %s %s", self.source, len(kept), type, self.what)
        return Dataset.from_list(kept)
