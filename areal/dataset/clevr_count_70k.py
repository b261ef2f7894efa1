"""CLEVR-Count-70K (``BUAADreamer/clevr_count_70k`` layout) from local files, and the
synthetic CLEVR-style counting set (``synthetic://clevr?...``).

Rows have ``images`` (one rendered scene), ``problem`` ("<image>How many items are
there?") and ``answer`` (a count). See :mod:`areal.dataset.vision` for file layouts, the
row formats of ``type`` ``rl`` / ``sft`` and the bad-row policy. As in AReaL, the RL
prompt asks for the count in brackets (``[3]``), which
:func:`areal.reward.clevr_count_70k.clevr_count_70k_reward_fn` checks; for the real data
that instruction is a system turn, for the synthetic set (sized for the tiny VLM) a short
suffix of the question (:data:`areal.dataset.synthetic_clevr.CLEVR_PROMPT_SUFFIX`).
"""

from __future__ import annotations

from typing import Any

from areal.dataset.synthetic_clevr import (
    CLEVR_PROMPT_SUFFIX,
    generate_clevr_rows,
    is_clevr_path,
    parse_clevr_path,
)
from areal.dataset.vision import build_vision_dataset, clean_vision_rows, get_vision_dataset

CLEVR_SYSTEM_PROMPT = (
    "Count the items the question asks about in the image. Give the final answer as a "
    "number inside [ ], with nothing else inside the brackets."
)


def _synthetic_rows(path: str, split: str) -> list[dict]:
    rows = generate_clevr_rows(parse_clevr_path(path), split)
    return clean_vision_rows(rows, f"{path}[{split}]", max_bad_fraction=0.0)


def get_clevr_count_70k_rl_dataset(
    path: str,
    split: str,
    processor: Any = None,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
    prompt_suffix: str | None = None,
):
    """RL rows (``messages``, ``images``, ``answer``, ``query_id``)."""
    if is_clevr_path(path):
        suffix = CLEVR_PROMPT_SUFFIX if prompt_suffix is None else prompt_suffix
        return build_vision_dataset(
            _synthetic_rows(path, split),
            "rl",
            processor,
            max_length,
            suffix,
            source=f"{path}[{split}]",
        )
    return get_vision_dataset(
        path,
        split,
        "rl",
        processor,
        max_length,
        max_bad_fraction,
        prompt_suffix=prompt_suffix or "",
        system_prompt=CLEVR_SYSTEM_PROMPT,
    )


def get_clevr_count_70k_sft_dataset(
    path: str,
    split: str,
    processor: Any,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
):
    """SFT rows (``input_ids``, ``loss_mask``, ``multi_modal_input``); the target is ``[N]``
    for the synthetic set (the reward's format) and the released answer otherwise."""
    if is_clevr_path(path):
        rows = [dict(r, answer=f"[{r['answer']}]") for r in _synthetic_rows(path, split)]
        return build_vision_dataset(
            rows, "sft", processor, max_length, CLEVR_PROMPT_SUFFIX, source=f"{path}[{split}]"
        )
    return get_vision_dataset(path, split, "sft", processor, max_length, max_bad_fraction)
