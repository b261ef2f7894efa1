"""Anthropic HH-RLHF preference pairs from local files, for reward modelling and DPO.

The released format (``hh-rlhf/*/train.jsonl.gz`` / ``test.jsonl.gz``, or their unpacked
``.jsonl``) has one pair per line: ``{"chosen": TRANSCRIPT, "rejected": TRANSCRIPT}``
where each transcript is the whole conversation, ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``,
and the two differ only in the final assistant turn.

``type="rw"`` rows: ``chosen_ids`` / ``rejected_ids`` (transcript + EOS, tokenized).
``type="dpo"`` rows: the same plus ``chosen_loss_mask`` / ``rejected_loss_mask`` (1 on the
tokens after the longest common token prefix of the pair, i.e. on the responses), as
AReaL's ``get_hhrlhf_dpo_dataset`` builds them.

Unusable lines (bad JSON, missing or non-string fields, identical chosen/rejected) are
skipped and counted; more than ``max_bad_fraction`` of them is an error. Pairs with a
side longer than ``max_length`` tokens are dropped (counted in the log).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

from areal.dataset.rows import LengthFilter
from areal.utils import logging

logger = logging.getLogger("HHRLHFDataset")

PREFERENCE_TYPES = ("rw", "dpo")


def _find_file(path: str, split: str) -> str:
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for name in (f"{split}.jsonl", f"{split}.jsonl.gz", f"{split}.json"):
            cand = os.path.join(path, name)
            if os.path.isfile(cand):
                return cand
        raise FileNotFoundError(
            f"HH-RLHF directory {path!r} has no {split}.jsonl / {split}.jsonl.gz / {split}.json"
        )
    raise FileNotFoundError(f"HH-RLHF path {path!r} does not exist (local files only)")


def read_hhrlhf_rows(path: str, split: str = "train") -> tuple[list[dict | None], str]:
    """Raw rows (``None`` for unparseable lines) and the file they came from."""
    fname = _find_file(path, split)
    opener = gzip.open if fname.endswith(".gz") else open
    rows: list[dict | None] = []
    with opener(fname, "rt", encoding="utf-8") as f:
        if fname.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise ValueError(f"{fname}: expected a JSON list of rows")
            return [r if isinstance(r, dict) else None for r in data], fname
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            rows.append(row if isinstance(row, dict) else None)
    return rows, fname


def tokenize_pair(
    tokenizer: Any, prompt: str, chosen: str, rejected: str, with_mask: bool
) -> dict[str, list[int]]:
    """Token ids of ``prompt + chosen + EOS`` and ``prompt + rejected + EOS``.

    ``with_mask``: add ``*_loss_mask`` with 1 on the tokens after the pair's longest
    common prefix (the responses). The prompt may be empty (HH-RLHF transcripts carry it).
    """
    eos = tokenizer.eos_token_id
    c = tokenizer(prompt + chosen, add_special_tokens=False)["input_ids"] + [eos]
    r = tokenizer(prompt + rejected, add_special_tokens=False)["input_ids"] + [eos]
    out = {"chosen_ids": c, "rejected_ids": r}
    if with_mask:
        n = 0
        for a, b in zip(c, r, strict=False):
            if a != b:
                break
            n += 1
        # at least one loss token on each side (identical sequences have none)
        n = min(n, len(c) - 1, len(r) - 1)
        out["chosen_loss_mask"] = [0] * n + [1] * (len(c) - n)
        out["rejected_loss_mask"] = [0] * n + [1] * (len(r) - n)
    return out


def build_preference_dataset(
    pairs: list[tuple[str, str, str]],
    type: str,
    tokenizer: Any,
    max_length: int | None,
    source: str,
):
    """``(prompt, chosen, rejected)`` triples -> a ``datasets.Dataset`` of tokenized pairs."""
    if type not in PREFERENCE_TYPES:
        raise ValueError(f"preference dataset type={type!r}; allowed: {list(PREFERENCE_TYPES)}")
    if tokenizer is None:
        raise ValueError(f"{source}: a tokenizer is needed to build preference pairs")
    lengths = LengthFilter(max_length, source, logger, what="pairs")
    out = []
    for prompt, chosen, rejected in pairs:
        row = tokenize_pair(tokenizer, prompt, chosen, rejected, with_mask=type == "dpo")
        if lengths.too_long(max(len(row["chosen_ids"]), len(row["rejected_ids"]))):
            continue
        out.append(row)
    return lengths.dataset(out, len(pairs), type)


def get_hhrlhf_dataset(
    path: str,
    split: str,
    type: str,
    tokenizer: Any,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
):
    """HH-RLHF pairs from a local ``.jsonl`` / ``.jsonl.gz`` / ``.json`` file or a directory
    holding ``{split}.jsonl[.gz]`` (see module docstring)."""
    if not 0 <= max_bad_fraction <= 1:
        raise ValueError(f"max_bad_fraction={max_bad_fraction}; must be in [0, 1]")
    rows, fname = read_hhrlhf_rows(path, split)
    pairs: list[tuple[str, str, str]] = []
    reasons: dict[str, int] = {}
    for row in rows:
        why = None
        if row is None:
            why = "not a JSON object"
        elif not isinstance(row.get("chosen"), str) or not isinstance(row.get("rejected"), str):
            why = "missing chosen/rejected string"
        elif row["chosen"] == row["rejected"]:
            why = "chosen == rejected"
        elif not row["chosen"].strip() or not row["rejected"].strip():
            why = "empty transcript"
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
            continue
        pairs.append(("", row["chosen"], row["rejected"]))
    n_bad = len(rows) - len(pairs)
    if n_bad:
        logger.warning("%s: skipped %d of %d rows (%s)", fname, n_bad, len(rows), reasons)
    if not rows:
        raise ValueError(f"{fname}: no rows")
    if n_bad / len(rows) > max_bad_fraction:
        raise ValueError(
            f"{fname}: {n_bad} of {len(rows)} rows are bad ({n_bad / len(rows):.1%} > "
            f"max_bad_fraction={max_bad_fraction:.1%}): {reasons}"
        )
    return build_preference_dataset(pairs, type, tokenizer, max_length, source=fname)


def get_hhrlhf_rw_dataset(path: str, split: str, tokenizer: Any, max_length: int | None = None):
    """AReaL's name: reward-model pairs (``chosen_ids`` / ``rejected_ids``)."""
    return get_hhrlhf_dataset(path, split, "rw", tokenizer, max_length)


def get_hhrlhf_dpo_dataset(path: str, split: str, tokenizer: Any, max_length: int | None = None):
    """AReaL's name: DPO pairs (ids and response loss masks)."""
    return get_hhrlhf_dataset(path, split, "dpo", tokenizer, max_length)
