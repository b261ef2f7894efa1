"""Geometry3K (``hiyouga/geometry3k`` layout) from local files: geometry problems with a figure.

Rows have ``images`` (one figure), ``problem`` (with an ``<image>`` placeholder) and
``answer`` (e.g. ``3``, ``2\\sqrt{3}``). See :mod:`areal.dataset.vision` for the file
layouts, the row formats of ``type`` ``rl`` / ``sft`` and the bad-row policy. The RL
prompt asks for reasoning in ``<think>`` tags and the final answer in ``\\boxed{}`` (AReaL's
instruction); :func:`areal.reward.geometry3k.geometry3k_reward_fn` scores it.
"""

from __future__ import annotations

from typing import Any

from areal.dataset.vision import get_vision_dataset

GEOMETRY3K_PROMPT_SUFFIX = (
    " First think about the reasoning process inside <think> </think> tags, then give the "
    "final answer in \\boxed{}."
)


def get_geometry3k_rl_dataset(
    path: str,
    split: str,
    processor: Any = None,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
    prompt_suffix: str | None = None,
):
    """RL rows (``messages``, ``images``, ``answer``, ``query_id``)."""
    suffix = GEOMETRY3K_PROMPT_SUFFIX if prompt_suffix is None else prompt_suffix
    return get_vision_dataset(
        path, split, "rl", processor, max_length, max_bad_fraction, prompt_suffix=suffix
    )


def get_geometry3k_sft_dataset(
    path: str,
    split: str,
    processor: Any,
    max_length: int | None = None,
    max_bad_fraction: float = 0.1,
):
    """SFT rows (``input_ids``, ``loss_mask``, ``multi_modal_input``): problem -> answer."""
    return get_vision_dataset(path, split, "sft", processor, max_length, max_bad_fraction)
