"""GSM8K-format datasets (real GSM8K from a local file, or synthetic arithmetic).

Rows in the source have ``question`` and ``answer`` (reasoning, final line ``#### N``).

- ``type="rl"`` rows: ``messages`` (one user turn: the question, plus ``prompt_suffix``)
  and ``answer`` (the full solution; rewards read its ``#### N`` line).
- ``type="sft"`` rows: ``input_ids`` (chat prompt + solution + EOS) and ``loss_mask``
  (1 on the solution and EOS).

Rows with a missing/empty/non-string field, or an answer without a final ``#### N`` line
(or a bare number), are skipped and counted; if more than ``max_bad_fraction`` of the rows
are bad the loader raises ``ValueError``. Rows longer than ``max_length`` tokens (the chat
prompt for RL, the whole sequence for SFT) are dropped and counted in the log.
"""

from __future__ import annotations

import os

from areal.dataset.rows import LengthFilter, read_rows
from areal.reward import parse_number
from areal.utils import logging

logger = logging.getLogger("GSM8KDataset")

# AReaL's GSM8K RL prompt asks for a boxed answer; gsm8k_reward_fn accepts both styles.
GSM8K_PROMPT_SUFFIX = "\nPlease put your final answer within \\boxed{}."


def _valid_answer(answer: str) -> bool:
    if "####" in answer:
        return bool(answer.rsplit("####", 1)[1].strip())
    return parse_number(answer) is not None


def clean_rows(rows: list, source: str, max_bad_fraction: float = 0.1) -> list[dict]:
    """Keep rows with string ``question`` and a parseable ``answer``; count and check the rest."""
    if not 0 <= max_bad_fraction <= 1:
        raise ValueError(f"max_bad_fraction={max_bad_fraction}; must be in [0, 1]")
    good: list[dict] = []
    reasons: dict[str, int] = {}
    for row in rows:
        if not isinstance(row, dict):
            reason = "not a JSON object"
        elif not isinstance(row.get("question"), str) or not row["question"].strip():
            reason = "missing/empty 'question'"
        elif not isinstance(row.get("answer"), str) or not row["answer"].strip():
            reason = "missing/empty 'answer'"
        elif not _valid_answer(row["answer"]):
            reason = "answer has no final '#### N' line"
        else:
            good.append({"question": row["question"], "answer": row["answer"]})
            continue
        reasons[reason] = reasons.get(reason, 0) + 1
    n_bad = len(rows) - len(good)
    if n_bad:
        logger.warning("%s: skipped %d of %d rows (%s)", source, n_bad, len(rows), reasons)
    if rows and n_bad / len(rows) > max_bad_fraction:
        raise ValueError(
            f"{source}: {n_bad} of {len(rows)} rows are bad ({n_bad / len(rows):.1%} > "
            f"max_bad_fraction={max_bad_fraction:.1%}): {reasons}"
        )
    if not good:
        raise ValueError(f"{source}: no usable rows")
    return good


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)
    return list(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])


def build_gsm8k_dataset(
    rows: list[dict],
    type: str,
    tokenizer=None,
    max_length: int | None = None,
    prompt_suffix: str = "",
    source: str = "gsm8k",
):
    """``datasets.Dataset`` of RL (``messages``, ``answer``) or SFT (``input_ids``, ``loss_mask``) rows."""
    if type not in ("rl", "sft"):
        raise ValueError(f"dataset type={type!r}; allowed: 'rl', 'sft'")
    if max_length is not None and tokenizer is None:
        raise ValueError("max_length filtering needs a tokenizer")
    if type == "sft" and tokenizer is None:
        raise ValueError("type='sft' needs a tokenizer")
    lengths = LengthFilter(max_length, source, logger)
    out: list[dict] = []
    for row in rows:
        messages = [{"role": "user", "content": row["question"] + prompt_suffix}]
        if type == "rl":
            if max_length is not None and lengths.too_long(len(_prompt_ids(tokenizer, messages))):
                continue
            out.append({"messages": messages, "answer": row["answer"]})
        else:
            prompt = _prompt_ids(tokenizer, messages)
            target = list(tokenizer(row["answer"], add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                target.append(tokenizer.eos_token_id)
            ids = prompt + target
            if lengths.too_long(len(ids)):
                continue
            out.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(target)})
    return lengths.dataset(out, len(rows), type)


def get_gsm8k_dataset(
    path: str,
    split: str,
    type: str = "rl",
    tokenizer=None,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
    prompt_suffix: str | None = None,
    name: str | None = None,
):
    """GSM8K from a local file or directory (``{split}.jsonl`` / ``.parquet``, or a hub
    snapshot's ``{name}/{split}-*.parquet``, ``name`` defaulting to ``main``)."""
    rows, _ = read_rows(path, split, name)
    source = f"{os.fspath(path)}[{split}]"
    good = clean_rows(rows, source, max_bad_fraction)
    suffix = (
        GSM8K_PROMPT_SUFFIX if (prompt_suffix is None and type == "rl") else (prompt_suffix or "")
    )
    return build_gsm8k_dataset(good, type, tokenizer, max_length, suffix, source)
