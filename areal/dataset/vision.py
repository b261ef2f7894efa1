"""Shared reader for image question-answer datasets (Geometry3K, CLEVR-Count-70K).

Both public datasets are released as rows with ``images`` (a list of images), ``problem``
(text with one ``<image>`` placeholder per image) and ``answer``. This module reads them
from local files (``{split}.parquet`` / ``{split}-*.parquet`` / ``data/{split}-*.parquet``
as the hub snapshots lay them out, or ``.jsonl`` / ``.json``) and builds:

- ``type="rl"`` rows: ``messages`` (chat messages whose user ``content`` is a list of
  ``{"type": "image"}`` parts, one per image, then the text part), ``images`` (a list of
  encoded image bytes), ``answer`` (string) and ``query_id``;
- ``type="sft"`` rows: ``input_ids`` (prompt rendered by the processor with the image
  tokens expanded + answer + EOS), ``loss_mask`` (1 on the answer and EOS) and
  ``multi_modal_input`` (``[{"pixel_values", "image_grid_thw"}]``) as AReaL's VLM SFT
  datasets carry it.

Images may be ``{"bytes": ..., "path": ...}`` dicts (parquet), raw bytes, base64 strings,
data URLs, or file paths (relative paths are resolved against the data file's folder).
Rows with a missing/empty problem or answer, no image, an undecodable image, or a
placeholder count that differs from the number of images are skipped and counted; more
than ``max_bad_fraction`` bad rows raise ``ValueError``. Rows longer than ``max_length``
tokens (with image tokens expanded; prompt for RL, whole sequence for SFT) are dropped and
counted in the log.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from areal.dataset.rows import LengthFilter, read_rows, resolve_file
from areal.utils import logging
from areal.utils.vlm import load_image

logger = logging.getLogger("VisionDataset")


def _resolve_image(image: Any, base_dir: Path) -> Any:
    if isinstance(image, dict) and image.get("bytes") is None and image.get("path"):
        p = Path(image["path"])
        return str(p if p.is_absolute() else base_dir / p)
    if isinstance(image, str) and not image.startswith("data:") and len(image) < 4096:
        p = Path(image)
        cand = p if p.is_absolute() else base_dir / p
        if cand.exists():
            return str(cand)
    return image


def _encode(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def clean_vision_rows(
    rows: list, source: str, base_dir: str | os.PathLike = ".", max_bad_fraction: float = 0.1
) -> list[dict]:
    """Rows with usable ``problem``, ``answer`` and decodable ``images`` (PNG bytes)."""
    if not 0 <= max_bad_fraction <= 1:
        raise ValueError(f"max_bad_fraction={max_bad_fraction}; must be in [0, 1]")
    base = Path(base_dir)
    good: list[dict] = []
    reasons: dict[str, int] = {}
    for row in rows:
        reason = None
        if not isinstance(row, dict):
            reason = "not a JSON object"
        elif not isinstance(row.get("problem"), str) or not row["problem"].strip():
            reason = "missing/empty 'problem'"
        elif row.get("answer") is None or not str(row["answer"]).strip():
            reason = "missing/empty 'answer'"
        else:
            images = row.get("images")
            if images is None or (isinstance(images, list | tuple) and not images):
                reason = "no 'images'"
            else:
                if not isinstance(images, list | tuple):
                    images = [images]
                n_ph = row["problem"].count("<image>")
                if n_ph not in (0, len(images)):
                    reason = "<image> placeholders != number of images"
                else:
                    try:
                        encoded = [_encode(load_image(_resolve_image(im, base))) for im in images]
                    except Exception:  # noqa: BLE001 - any decoding failure is a bad row
                        reason = "undecodable image"
                    else:
                        good.append(
                            {
                                "problem": row["problem"],
                                "answer": str(row["answer"]).strip(),
                                "images": encoded,
                            }
                        )
        if reason is not None:
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


def problem_to_messages(
    problem: str, n_images: int, suffix: str = "", system: str | None = None
) -> list[dict]:
    """Chat messages: optional system turn, then the user turn (image parts + text)."""
    text = problem.replace("<image>", "").strip() + suffix
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    # list contents everywhere (a dataset column cannot mix strings and lists)
    msgs: list[dict] = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    msgs = msgs if system else []
    msgs.append({"role": "user", "content": content})
    return msgs


def build_vision_dataset(
    rows: list[dict],
    type: str,
    processor: Any = None,
    max_length: int | None = None,
    prompt_suffix: str = "",
    system_prompt: str | None = None,
    source: str = "vision",
):
    """``datasets.Dataset`` of RL or SFT rows (see module docstring) from cleaned rows."""
    if type not in ("rl", "sft"):
        raise ValueError(f"dataset type={type!r}; allowed: 'rl', 'sft'")
    if (type == "sft" or max_length is not None) and processor is None:
        raise ValueError(
            f"{source}: type={type!r} with max_length={max_length} needs a processor "
            "(AutoProcessor of the VLM)"
        )
    lengths = LengthFilter(max_length, source, logger)
    out: list[dict] = []
    for i, row in enumerate(rows):
        msgs = problem_to_messages(row["problem"], len(row["images"]), prompt_suffix, system_prompt)
        if type == "rl" and max_length is None:
            out.append(
                {"messages": msgs, "images": row["images"], "answer": row["answer"], "query_id": i}
            )
            continue
        text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], images=[load_image(b) for b in row["images"]])
        prompt = enc["input_ids"][0].tolist()
        if type == "rl":
            if lengths.too_long(len(prompt)):
                continue
            out.append(
                {"messages": msgs, "images": row["images"], "answer": row["answer"], "query_id": i}
            )
            continue
        tok = getattr(processor, "tokenizer", processor)
        target = tok.encode(row["answer"], add_special_tokens=False) + [tok.eos_token_id]
        ids = prompt + target
        if lengths.too_long(len(ids)):
            continue
        out.append(
            {
                "input_ids": ids,
                "loss_mask": [0] * len(prompt) + [1] * len(target),
                "multi_modal_input": [
                    {
                        "pixel_values": enc["pixel_values"].tolist(),
                        "image_grid_thw": enc["image_grid_thw"].tolist(),
                    }
                ],
            }
        )
    return lengths.dataset(out, len(rows), type)


def get_vision_dataset(
    path: str,
    split: str,
    type: str = "rl",
    processor: Any = None,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
    prompt_suffix: str = "",
    system_prompt: str | None = None,
):
    """Read a local Geometry3K / CLEVR-style file or directory and build the dataset."""
    file = resolve_file(path, split)
    rows, _ = read_rows(path, split)
    source = f"{os.fspath(path)}[{split}]"
    good = clean_vision_rows(rows, source, file.parent, max_bad_fraction)
    return build_vision_dataset(
        good, type, processor, max_length, prompt_suffix, system_prompt, source
    )
